"""scripts/take_away.py's temporary builds (no GPU): every cut's edits still find their anchors in
today's kernels_cu, a stale anchor stops the script with a one-line error, its source switch
points runtime/cuda/compile.py at the copy and back, the launch cut "wo" leaves out exactly the
one-token output product, "moe-nx" hands the products after a MoE layer a zeroed handoff,
"dense-nx" the products after any residual product that hands them none, and "nq16" (16-output
units) admits the NQ launch where its units fit the grid and patches the balance rule only while
its sources are in use; every cut of .cu files compiles for sm_90 where nvcc is on PATH."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from k4.kernels_cu import SOURCE_DIR
from k4.runtime.cuda import compile as comp
from k4.runtime.cuda import gemv_choice, quant_kernels
from scripts.take_away import CUT_PATCHES, CUTS, LAUNCH_CUTS, apply_cut, use_sources


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_every_cut_applies_to_todays_kernels(tmp_path, cut):
    apply_cut(SOURCE_DIR, tmp_path, CUTS[cut][1])
    files = {name for name, _, _ in CUTS[cut][1]}
    for name in files:
        assert (tmp_path / name).read_text() != (SOURCE_DIR / name).read_text()
    untouched = {p.name for p in SOURCE_DIR.glob("*.cu*")} - files
    assert all((tmp_path / n).read_text() == (SOURCE_DIR / n).read_text() for n in untouched)


def test_a_stale_anchor_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="occurs 0 times in kernels_cu/attention_short.cu"):
        apply_cut(SOURCE_DIR, tmp_path, [("attention_short.cu", "no such line\n", "")])


def test_use_sources_switches_the_compiler_and_back(tmp_path, monkeypatch):
    monkeypatch.setattr(comp, "OPTIONS", comp.OPTIONS)
    monkeypatch.setattr(comp, "SOURCE_DIR", comp.SOURCE_DIR)
    digest = comp.headers_digest()
    apply_cut(SOURCE_DIR, tmp_path, CUTS["down-x"][1])  # a header edit: the digest must change
    try:
        use_sources(tmp_path)
        assert comp.SOURCE_DIR == tmp_path and f"-I{tmp_path}" in comp.OPTIONS and f"-I{SOURCE_DIR}" not in comp.OPTIONS
        assert comp.headers_digest() != digest
        assert quant_kernels._kernel.cache_info().currsize == 0
    finally:
        use_sources(Path(SOURCE_DIR))
    assert comp.SOURCE_DIR == SOURCE_DIR and f"-I{SOURCE_DIR}" in comp.OPTIONS and comp.headers_digest() == digest


def test_the_wo_cut_leaves_out_only_the_one_token_output_product():
    from types import SimpleNamespace

    import numpy as np

    calls = []

    class Forward:  # what the cut patches of runtime/cuda/forward.py's
        def residual(self, w, X, res, Y, post_norm, x_q8=None, nq=None, variant=None):
            calls.append((X.shape[0], w.shape[1]))

    fwd = SimpleNamespace(cfg=SimpleNamespace(q_dim=64))
    wo, down = SimpleNamespace(shape=(48, 64)), SimpleNamespace(shape=(48, 160))
    undo = LAUNCH_CUTS["wo"][1](Forward)
    try:
        Forward.residual(fwd, wo, np.zeros((1, 64)), None, None, None)  # left out
        Forward.residual(fwd, wo, np.zeros((5, 64)), None, None, None)  # prefill, verify: kept
        Forward.residual(fwd, wo, np.zeros((1, 64)), None, None, "post-norm")  # gemma's: kept
        Forward.residual(fwd, down, np.zeros((1, 160)), None, None, None, x_q8=None)
    finally:
        undo()
    assert calls == [(5, 64), (1, 64), (1, 160)]
    Forward.residual(fwd, wo, np.zeros((1, 64)), None, None, None)
    assert calls[-1] == (1, 64)


def test_the_moe_nx_cut_hands_the_next_norm_a_zeroed_handoff(monkeypatch):
    """After one token's MoE feed-forward the cut leaves Forward.nq a handoff (the zeroed buffers,
    the parts, the norm's eps) for the next layer's norm, after the last layer the output norm's;
    prompts (n > 1) and layers without a reader are left alone, and the undo restores moe_ffn."""
    from types import SimpleNamespace

    import numpy as np
    from gguf import GGMLQuantizationType as T

    from k4.runtime.cuda import launch

    monkeypatch.setattr(launch, "capturing", lambda stream: False)
    calls = []
    moe = SimpleNamespace(moe_ffn=lambda fwd, L, x1, x, n, *a: calls.append(n))
    layers = [SimpleNamespace(attn_norm=f"norm{i}") for i in range(3)]
    reader = SimpleNamespace(ggml_type=T.Q4_K, shape=(512, 256))
    act = SimpleNamespace(nq8=np.full(4096, 7, np.uint8), nq_parts=np.ones(64, np.float32))
    fwd = SimpleNamespace(w=SimpleNamespace(layers=layers, output_norm="out_norm"), act=act, nq=None,
                          cfg=SimpleNamespace(rms_eps=1e-6), hand=SimpleNamespace(readers=lambda li: (None, None if li == 1 else reader)))
    undo = LAUNCH_CUTS["moe-nx"][1](moe)
    try:
        moe.moe_ffn(fwd, layers[0], None, None, 4)  # a prompt: nothing handed over
        assert fwd.nq is None
        moe.moe_ffn(fwd, layers[0], None, None, 1)
        vec, norm_w = fwd.nq
        assert norm_w == "norm1" and vec.data is act.nq8 and vec.parts is act.nq_parts and (vec.n, vec.n_parts) == (256, 1)
        assert not act.nq8.any() and not act.nq_parts.any() and vec.eps == 1e-6
        fwd.nq = None
        moe.moe_ffn(fwd, layers[1], None, None, 1)  # no reader after layer 1
        assert fwd.nq is None
        moe.moe_ffn(fwd, layers[2], None, None, 1)
        assert fwd.nq[1] == "out_norm"
    finally:
        undo()
    assert calls == [4, 1, 1, 1]
    moe.moe_ffn(fwd, layers[0], None, None, 1)
    assert calls[-1] == 1 and fwd.nq[1] == "out_norm"


def test_the_dense_nx_cut_hands_a_zeroed_handoff_where_the_product_hands_none(monkeypatch):
    """After one token's residual product without a post-norm that left Forward.nq empty, the cut
    leaves it a handoff (the zeroed buffers, one part, the norm's eps) for nq's reader and norm;
    a real handoff, several rows, a post-norm or no reader are left alone; the undo restores it."""
    from types import SimpleNamespace

    import numpy as np
    from gguf import GGMLQuantizationType as T

    from k4.runtime.cuda import launch

    monkeypatch.setattr(launch, "capturing", lambda stream: False)
    calls = []

    class Fwd:
        def residual(self, w, X, res, Y, post_norm, x_q8=None, nq=None, variant=None):
            calls.append(X.shape[0])
            if w == "hands":
                self.nq = ("real", nq[0])

    reader = SimpleNamespace(ggml_type=T.Q4_K, shape=(512, 256))
    act = SimpleNamespace(nq8=np.full(4096, 7, np.uint8), nq_parts=np.ones(64, np.float32))
    fwd = Fwd()
    fwd.act, fwd.nq, fwd.cfg = act, None, SimpleNamespace(rms_eps=1e-6)
    one, four = np.zeros((1, 8)), np.zeros((4, 8))
    undo = LAUNCH_CUTS["dense-nx"][1](Fwd)
    try:
        fwd.residual("w", four, None, None, None, nq=("norm", reader))  # a prompt: nothing handed over
        fwd.residual("w", one, None, None, "post", nq=("norm", reader))  # a post-norm
        fwd.residual("w", one, None, None, None, nq=("norm", None))  # no reader
        assert fwd.nq is None
        fwd.residual("hands", one, None, None, None, nq=("norm", reader))
        assert fwd.nq == ("real", "norm")
        fwd.nq = None
        fwd.residual("w", one, None, None, None, nq=("norm", reader))
        vec, norm_w = fwd.nq
        assert norm_w == "norm" and vec.data is act.nq8 and vec.parts is act.nq_parts and (vec.n, vec.n_parts) == (256, 1)
        assert not act.nq8.any() and not act.nq_parts.any() and vec.eps == 1e-6
    finally:
        undo()
    assert calls == [4, 1, 1, 1, 1]
    fwd.nq = None
    fwd.residual("w", one, None, None, None, nq=("norm", reader))
    assert fwd.nq is None and calls[-1] == 1


def test_the_nq16_patch_admits_units_that_fit_and_stops_where_main_hands_off():
    """One 16-output unit a block of 16 warps: TinyLlama's 2,048 outputs on 132 blocks are admitted
    (main's rule refuses them); a product main hands off that the cut cannot map stops the run
    (the 7B's 4,096 outputs in 32-warp blocks); one neither hands off stays without; the undo."""
    from types import SimpleNamespace

    from k4.runtime.cuda.gemv_choice import nq_balanced

    mm = SimpleNamespace(nq_balanced=nq_balanced)
    assert not nq_balanced(2048, 2048, 132, 16) and nq_balanced(4096, 4096, 132, 32)
    undo = CUT_PATCHES["nq16"](mm)
    try:
        assert mm.nq_balanced(2048, 2048, 132, 16) and mm.nq_balanced(2048, 5632, 132, 16)
        assert not mm.nq_balanced(2048, 2048, 127, 16)  # 128 units on 127 blocks: main refuses it too
        with pytest.raises(SystemExit, match="cannot map the 4096-output NQ product onto 132 blocks of 32 warps"):
            mm.nq_balanced(4096, 4096, 132, 32)
    finally:
        undo()
    assert mm.nq_balanced is nq_balanced


def _cut_instances(filename: str) -> list[str]:
    """What a cut of kernels_cu/filename is compiled with: gemv.cu's NQ instances and their readers
    (both types, both layouts, clusters) and a plain one; every instance of a smaller file."""
    from k4.runtime.cuda import kernel_names

    if filename == "gemv.cu":
        nq = [n for t in gemv_choice.NQ_TYPES for n in quant_kernels.GROUPS["gemv.cu"][f"{t.name}.nq"]]
        return nq + [quant_kernels.GROUPS["gemv.cu"]["Q4_K"][0]]
    groups = quant_kernels.GROUPS.get(filename)
    return [n for g in (groups.values() if groups else kernel_names.GROUPS[filename]) for n in g]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("cut", sorted(c for c in CUTS if all(f.endswith(".cu") for f, _, _ in CUTS[c][1])))
def test_every_cut_of_a_kernel_file_compiles(tmp_path, cut):
    """A cut of .cu files compiles for sm_90 (nvcc, the options NVRTC gets at run time)."""
    from k4.runtime.cuda.compile import OPTIONS

    apply_cut(SOURCE_DIR, tmp_path, CUTS[cut][1])
    options = [o for o in OPTIONS if not o.startswith(("-I", "--gpu-architecture", "-arch"))]
    for filename in sorted({f for f, _, _ in CUTS[cut][1]}):
        refs = ", ".join(f"(void*)&{n}" for n in _cut_instances(filename))
        (tmp_path / "some.cu").write_text(f'#include "{filename}"\nvoid* const k4_some[] = {{{refs}}};\n')
        cmd = ["nvcc", "-arch=sm_90", f"-I{tmp_path}", *options, "-c", str(tmp_path / "some.cu"), "-o", str(tmp_path / "k.o")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("cut", ["norm-sum", "wo", "nq16"])
def test_main_alternates_main_and_the_cut_and_restores_both(cut, monkeypatch, capsys):
    """The script's loop (the bench stubbed): main and the cut in turn for each round, the sources
    (or the forward pass) back as they were after each cut run, and the per-layer figure printed."""
    from types import SimpleNamespace

    import scripts.take_away as ta
    from k4.runtime import model

    monkeypatch.setattr(comp, "OPTIONS", comp.OPTIONS)
    monkeypatch.setattr(comp, "SOURCE_DIR", comp.SOURCE_DIR)
    monkeypatch.setattr(model, "open_model", lambda path: SimpleNamespace(config=SimpleNamespace(n_layer=4)))
    undone = []
    if cut in ta.LAUNCH_CUTS:
        monkeypatch.setitem(ta.LAUNCH_CUTS, cut, (ta.LAUNCH_CUTS[cut][0], lambda: (lambda: undone.append(True))))
    if cut in ta.CUT_PATCHES:
        monkeypatch.setitem(ta.CUT_PATCHES, cut, lambda: (lambda: undone.append(True)))
    seen = []
    monkeypatch.setattr(ta, "bench_ts", lambda args, test: seen.append(comp.SOURCE_DIR) or (100.0 if len(seen) % 2 else 125.0))
    ta.main([cut, "-m", "model.gguf", "--rounds", "2"])
    assert len(seen) == 4 and seen[0] == seen[2] == SOURCE_DIR
    assert (seen[1] == seen[3] == SOURCE_DIR) == (cut == "wo") and comp.SOURCE_DIR == SOURCE_DIR
    assert undone == ([True, True] if cut in ("wo", "nq16") else [])
    out = capsys.readouterr().out
    assert "main 100.00 t/s, without it 125.00 t/s (+25.0%): 2000.0 µs a step, 500.00 µs a layer (4 layers)" in out
