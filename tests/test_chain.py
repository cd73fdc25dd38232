"""K4_COUNT_WAIT without a GPU: how runtime/cuda/chain.py hands out the decode step's slots (which
launch waits on a count and which on the grid), and, where nvcc and cuobjdump are on PATH, what
kernels_cu/chain.cuh compiles to: nothing at all in a build without the flag (the kernels' code
as before), and in a build with it a poll loop that invalidates no L1, one acquire fence after
it, and one release fence before each count."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from k4.kernels_cu import SOURCE_DIR
from k4.runtime.cuda.chain import (
    LINKS_PER_LAYER,
    Chain,
    ChainFull,
    chain_args,
    chain_slots,
    last_args,
    slot_of,
    waits_for_grid,
)
from k4.runtime.cuda.compile import OPTIONS
from k4.runtime.cuda.constants import CHAIN_DONE, CHAIN_GRID

from scripts.sass_loops import functions
from tests.test_boundary_wait import poll_loops

TOOLS = shutil.which("nvcc") is not None and shutil.which("cuobjdump") is not None


class Launches:
    """launch.launch_count's stand-in: the test says when a kernel launches."""

    def __init__(self):
        self.n = 0

    def __call__(self) -> int:
        return self.n


def linked(chain: Chain, launches: Launches) -> int:
    """One linked launch: its `at`."""
    slots, at = chain.link()
    assert slots is chain.slots and isinstance(at, np.int32)
    launches.n += 1
    return int(at)


def test_consecutive_links_wait_on_counts_and_the_first_on_the_grid():
    launches = Launches()
    launches.n = 7  # launches before the step (an earlier step's, the prefill's)
    chain = Chain("slots", 16, launches)
    launches.n += 1  # the embedding lookup: not linked
    ats = [linked(chain, launches) for _ in range(4)]
    assert waits_for_grid(ats[0]) and slot_of(ats[0]) == 0
    assert ats[1:] == [1, 2, 3]  # each waits on the slot before its own
    assert not any(waits_for_grid(a) for a in ats[1:]) and [slot_of(a) for a in ats[1:]] == [1, 2, 3]
    assert chain.used == 4


def test_a_launch_the_chain_did_not_link_makes_the_next_wait_on_the_grid():
    launches = Launches()
    chain = Chain("slots", 16, launches)
    assert linked(chain, launches) == 0 | CHAIN_GRID
    assert linked(chain, launches) == 1
    launches.n += 1  # e.g. attn_gqa, a MoE kernel or rms_norm_add: no count
    at = linked(chain, launches)
    assert waits_for_grid(at) and slot_of(at) == 2
    assert linked(chain, launches) == 3
    launches.n += 2
    _, last = chain.last()
    assert waits_for_grid(int(last)) and slot_of(int(last)) == 4  # sample_finish zeroes slots 0..3


def test_the_last_launch_waits_on_the_head_closes_the_step_and_zeroes_what_it_used():
    launches = Launches()
    chain = Chain("slots", 16, launches)
    for _ in range(3):
        linked(chain, launches)
    _, at = chain.last()
    assert int(at) == 3  # waits on slot 2's count, zeroes slots 0..2
    launches.n += 1
    with pytest.raises(RuntimeError, match="after the decode step's last"):
        chain.link()
    with pytest.raises(RuntimeError, match="after the decode step's last"):
        chain.last()


def test_a_step_without_links_still_ends_on_the_grid():
    launches = Launches()
    chain = Chain("slots", 4, launches)
    launches.n += 5  # the megakernel's step, or every kernel unlinked
    _, at = chain.last()
    assert int(at) == CHAIN_GRID  # no slot to zero


def test_more_links_than_slots_is_refused_with_its_reason():
    launches = Launches()
    chain = Chain("slots", 2, launches)
    linked(chain, launches)
    linked(chain, launches)
    with pytest.raises(ChainFull, match="more than 2 launches"):
        chain.link()
    with pytest.raises(ValueError, match="at least one slot"):
        Chain("slots", 0, launches)
    one = Chain("slots", 1, launches)
    assert linked(one, launches) == CHAIN_GRID
    with pytest.raises(ChainFull):
        one.link()


def test_no_chain_passes_a_null_pointer_and_zero():
    for args in (chain_args(None), last_args(None)):
        assert [type(a) for a in args] == [np.uint64, np.int32] and [int(a) for a in args] == [0, 0]


def test_the_slots_hold_every_layers_links_and_the_bits_stay_apart():
    for n_layer in (1, 22, 32, 80):
        assert chain_slots(n_layer) >= LINKS_PER_LAYER * n_layer + 2  # the head and the last launch
        assert chain_slots(n_layer) < CHAIN_GRID
    assert CHAIN_GRID & (CHAIN_GRID - 1) == 0 and CHAIN_DONE < CHAIN_GRID
    assert CHAIN_DONE > 132 * 8 * 4  # above any grid's blocks: a product's, attn_short's (heads x splits)


# ---- what chain.cuh compiles to (nvcc, cuobjdump) ------------------------------------------------

KERNELS = {  # file -> the instances checked (the q/k/v pair, a plain product, attn_short, the sampler)
    "gemv.cu": ("gemv_q8_pair<type_q4_K, type_q6_K, true, 16, 2, true, 2, true, true>",
                "gemv_q8<type_q4_K, true, 16, 2, true, false>"),
    "attention_short.cu": ("attn_short<128>",),
    "sampling.cu": (),
}


def build(tmp_path, filename: str, count_wait: bool) -> tuple[str, dict[str, str]]:
    """(PTX, SASS per function) of `filename`'s KERNELS instances, with or without K4_COUNT_WAIT=1."""
    tag = f"{filename.split('.')[0]}_{int(count_wait)}"
    src = tmp_path / f"{tag}.cu"
    refs = ",\n".join(f"(void*)&{name}" for name in KERNELS[filename])
    src.write_text(f'#include "{SOURCE_DIR / filename}"\n'
                   + (f"extern void* const k4_i[];\nvoid* const k4_i[] = {{{refs}}};\n" if refs else ""))
    defines = ["-DK4_COUNT_WAIT=1"] if count_wait else []
    for kind in ("ptx", "cubin"):
        out = subprocess.run(["nvcc", "-arch=sm_90", *OPTIONS, *defines, f"-{kind}", "-o", str(tmp_path / f"{tag}.{kind}"), str(src)],
                             capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
    sass = subprocess.run(["cuobjdump", "-sass", str(tmp_path / f"{tag}.cubin")], capture_output=True, text=True, check=True).stdout
    return (tmp_path / f"{tag}.ptx").read_text(), functions(sass)


@pytest.mark.skipif(not TOOLS, reason="nvcc and cuobjdump are not on PATH")
@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_without_the_flag_no_chain_code_and_with_it_relaxed_polls(tmp_path, filename):
    ptx_off, sass_off = build(tmp_path, filename, False)
    assert not re.search(r"fence\.release|red\.relaxed\.gpu|ld\.relaxed\.gpu", ptx_off)
    assert "griddepcontrol.wait" in ptx_off
    ptx_on, sass_on = build(tmp_path, filename, True)
    assert "fence.acquire.gpu" in ptx_on and "ld.relaxed.gpu" in ptx_on
    assert ("red.relaxed.gpu" in ptx_on) == (filename != "sampling.cu")  # sample_finish waits and zeroes, never counts
    for name, text in sass_on.items():
        if name.startswith(("_Z7gemv_q8", "_Z12gemv_q8_pair", "_Z10attn_short", "sample_finish")):
            # the chain's poll: a loop of strong loads with no L1 invalidation in it (K4_HEAD_READY's acquire
            # poll in attn_short invalidates it on every turn, in both builds), and no such loop without the flag
            relaxed = [body for body in poll_loops(text) if not any("CCTL.IVALL" in t for t in body)]
            assert relaxed and not [b for b in poll_loops(sass_off[name]) if not any("CCTL.IVALL" in t for t in b)], name
            assert text.count("CCTL.IVALL") > sass_off[name].count("CCTL.IVALL"), name  # the acquire fence after it
            if name != "sample_finish":
                assert text.count("MEMBAR") > sass_off[name].count("MEMBAR"), name  # the release fence before a count


def test_the_flag_builds_every_gemv_module_a_second_time_with_the_define():
    from gguf import GGMLQuantizationType as T
    from k4.runtime.cuda.matrix_jobs import compile_jobs

    args = ([T.Q4_K, T.Q6_K, T.F32], True, "silu", True, T.Q6_K, True)
    off, on = compile_jobs(*args), compile_jobs(*args, count_wait=True)
    assert on[: len(off)] == off
    gemv = [(f, names, d) for f, names, d in off if f == "gemv.cu"]
    assert gemv and on[len(off):] == [(f, names, (*d, "K4_COUNT_WAIT=1")) for f, names, d in gemv]
