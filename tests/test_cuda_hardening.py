"""Hardening on the GPU: CUDA errors name the kernel and the phase; Ctrl-C during load or
generation exits with 130 and gives the GPU memory back; 20,000 decoded tokens and 50 chat turns
grow neither GPU nor host memory (tests/soak.py); the same seed gives the same tokens across
backends, reset(), the CUDA graph switch and processes.

The long runs use the synthetic TinyLlama 1.1B (exact shape and Q4_K_M layout, Llama 2's
32,000-token vocabulary from tests/data/vocab, so random ids decode to text), written once per session."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from tests.gpu import cupy_or_skip
from k4.runtime.chat import ChatSession
from k4.runtime.chat_template import ChatTemplate
from k4.runtime.errors import GpuError
from k4.runtime.flags import FLAGS
from k4.runtime.model import open_model
from k4.runtime.sampling import SamplingParams
from k4.runtime.synthetic import write_synthetic
from k4.runtime.tokenizer import Tokenizer
from k4.runtime.trace import Trace
from tests.soak import soak_chat, soak_decode

cp = cupy_or_skip()
pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
PROMPT = "Once upon a time"
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
GREEDY = SamplingParams(temperature=0.0)
MEMORY_TOLERANCE = 16 * MiB  # host RSS and driver free-memory change allowed over a long run
RETURNED_TOLERANCE = 8 * MiB  # GPU memory a finished child may appear to keep

# `k4 run` whose weight upload stops, once 256 MiB are on the device, to print a marker on stderr
# and sleep: a SIGINT sent after the marker lands inside CudaBackend.__init__, every time.
SLOW_LOAD = """
import sys, time
from k4.runtime.cuda import memory
advance = memory.Uploader._advance
def slow_advance(self, nbytes):
    advance(self, nbytes)
    if self.done >= 256 << 20:
        sys.stderr.write("k4-test: uploading\\n")
        sys.stderr.flush()
        time.sleep(600)
memory.Uploader._advance = slow_advance
from k4.cli.app import main
main()
"""


@pytest.fixture(autouse=True)
def default_flags(monkeypatch):
    for name in FLAGS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def tinyllama(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("tinyllama") / "tinyllama-1.1b.gguf"
    return write_synthetic("tinyllama-1.1b", out, vocab=data / "vocab" / "ggml-vocab-llama-spm.gguf")


def cuda(mf, n_ctx: int):
    from k4.runtime.cuda.backend import CudaBackend

    return CudaBackend(mf, n_ctx)


def take(gen, n: int) -> list[int]:
    out = list(islice(gen, n))
    gen.close()
    return out


def free_bytes() -> int:
    return int(cp.cuda.runtime.memGetInfo()[0])


# ---- CUDA errors --------------------------------------------------------------------------------

def test_refused_launch_names_the_kernel_and_the_phase():
    from k4.runtime.cuda import ops
    from k4.runtime.cuda.launch import launch

    o = ops.Ops(Trace())
    set_i32 = o.function("elementwise.cu", "set_i32")
    dst = cp.zeros(1, cp.int32)
    trace = Trace()
    for pdl in (False, True):
        with trace.in_phase("decode"), pytest.raises(GpuError) as info:
            launch(set_i32, (1,), (2048,), (dst, np.int32(7)), trace=trace, pdl=pdl)
        assert str(info.value).startswith("CUDA refused to launch kernel set_i32 (grid (1,), block (2048,), 0 bytes shared) during decode: CUDA")
    x = cp.ones((1, 256), cp.float32)
    with trace.in_phase("prefill"), pytest.raises(GpuError, match=r"kernel rms_norm<float> \(grid \(1,\), block \(2048,\)"):
        launch(o.function("norm.cu", "rms_norm<float>"), (1,), (2048,), (x, x[0], x, np.int32(256), np.float32(1e-5)), trace=trace)
    launch(set_i32, (1,), (1,), (dst, np.int32(7)), trace=trace)  # the context is still usable
    assert int(dst.get()[0]) == 7


def test_errors_at_a_later_sync_name_the_phase_and_the_last_launch(data, monkeypatch):
    from k4.runtime.cuda import memory

    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    be = cuda(mf, 256)
    want = take(be.generate([1, 400, 50], GREEDY), 8)
    be.reset()

    def illegal_address(*args, **kwargs):
        raise cp.cuda.runtime.CUDARuntimeError(700)  # cudaErrorIllegalAddress, raised as CuPy would

    with monkeypatch.context() as m:
        m.setattr(memory, "d2h_sync", illegal_address)
        with pytest.raises(GpuError, match=r"^CUDA error during prefill, after kernel \S+ was launched: cudaErrorIllegalAddress"):
            be.eval([1, 400, 50])
    assert be.n_past == 0
    with monkeypatch.context() as m:
        m.setattr(be.runner, "read_slot", illegal_address)
        with pytest.raises(GpuError, match=r"^CUDA error during decode, after the decode graph \(\d+ kernels\) was launched"):
            take(be.generate([1, 400, 50], GREEDY), 8)
    be.reset()
    assert take(be.generate([1, 400, 50], GREEDY), 8) == want


# ---- Ctrl-C -------------------------------------------------------------------------------------

def read_until(proc: subprocess.Popen, pipe, done, timeout: float = 180.0) -> bytes:
    """Read the child's `pipe` until done(data), end of file or `timeout` seconds (then fail)."""
    sel = selectors.DefaultSelector()
    sel.register(pipe, selectors.EVENT_READ)
    data, end = b"", time.monotonic() + timeout
    while not done(data):
        left = end - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            pytest.fail(f"the child printed {data!r} and nothing more for {timeout:.0f} s")
        chunk = os.read(pipe.fileno(), 4096)
        if not chunk:
            break
        data += chunk
    return data


def interrupt(proc: subprocess.Popen) -> bytes:
    """Send SIGINT once, wait for the child to exit; its stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


def wait_for_free(before: int, seconds: float = 20.0) -> int:
    """Free GPU memory once it is back within RETURNED_TOLERANCE of `before` (the driver frees a
    dead process's memory as it tears its context down), or after `seconds`."""
    end = time.monotonic() + seconds
    while (free := free_bytes()) < before - RETURNED_TOLERANCE and time.monotonic() < end:
        time.sleep(0.1)
    return free


def test_ctrl_c_during_generation_exits_130_and_frees_gpu_memory(tinyllama):
    before = free_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "k4.cli", "run", "--backend", "cuda", "-m", str(tinyllama), "-n", "-1",
                             "-c", "4096", "--temp", "0", PROMPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = read_until(proc, proc.stdout, lambda d: len(d) >= len(PROMPT) + 16)
    during = free_bytes()
    err = interrupt(proc)
    assert len(out) >= len(PROMPT) + 16, err  # text was streaming when the signal came
    assert proc.returncode == 130, err
    assert b"interrupted" in err and b"Traceback" not in err
    assert during < before - 512 * MiB  # the child's model is visible in the measurement
    assert wait_for_free(before) >= before - RETURNED_TOLERANCE


def test_ctrl_c_during_load_exits_130_and_frees_gpu_memory(tinyllama):
    before = free_bytes()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "run", "--backend", "cuda", "-m", str(tinyllama), "-n", "8",
                             "-c", "4096", PROMPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    marker = read_until(proc, proc.stderr, lambda d: b"k4-test: uploading" in d)
    during = free_bytes()
    err = interrupt(proc)
    assert b"k4-test: uploading" in marker, err
    assert proc.returncode == 130, err
    assert b"interrupted" in err and b"Traceback" not in err
    assert during < before - 256 * MiB
    assert wait_for_free(before) >= before - RETURNED_TOLERANCE


# ---- long runs ----------------------------------------------------------------------------------

def assert_no_growth(result: dict) -> None:
    g = result["growth"]
    assert g["pool_used"] == 0 and g["pool_held"] == 0, result
    assert g["device_free"] >= -MEMORY_TOLERANCE and g["host_rss"] <= MEMORY_TOLERANCE, result


def test_20000_decoded_tokens_grow_no_memory(tinyllama):
    mf = open_model(tinyllama)
    prompt = Tokenizer.from_model(mf).encode(PROMPT)
    be = cuda(mf, 20480)
    r = soak_decode(be, prompt, SAMPLED, n_windows=10, window=2000)
    assert r["tokens"] == 20001 and r["depth"] == len(prompt) + 20000
    assert_no_growth(r)


def test_50_chat_turns_grow_no_memory(tinyllama):
    mf = open_model(tinyllama)
    tok = Tokenizer.from_model(mf)
    session = ChatSession(cuda(mf, 2048), tok, ChatTemplate.from_model(mf, tok), SAMPLED, n_predict=64)
    r = soak_chat(session, 50)
    assert r["dropped_turns"] > 0  # the conversation outgrew the context
    assert r["prefill_tokens"][1] < r["prompt_tokens"][1]  # and reused the cache before that
    assert_no_growth(r)


# ---- determinism --------------------------------------------------------------------------------

def test_same_seed_same_tokens_across_backends_reset_and_graph_switch(tinyllama, monkeypatch):
    mf = open_model(tinyllama)
    prompt = Tokenizer.from_model(mf).encode(PROMPT)

    def draw(be, params=SAMPLED) -> list[int]:
        be.reset()
        return take(be.generate(prompt, params), 300)

    first = cuda(mf, 4096)
    want = draw(first)
    assert draw(first) == want
    assert draw(first, SAMPLED.with_(seed=4321)) != want
    del first
    assert draw(cuda(mf, 4096)) == want
    monkeypatch.setenv("K4_CUDA_GRAPH", "0")
    no_graph = cuda(mf, 4096)
    assert no_graph.graph is None and draw(no_graph) == want


def test_same_seed_same_tokens_in_two_cuda_processes(data):
    def run() -> dict:
        r = subprocess.run([sys.executable, "-m", "k4.cli", "run", "--json", "--backend", "cuda", "-m",
                            str(data / "models" / "stories260K-pad-q4_k_m.gguf"), "--seed", "1234", "--temp", "0.8",
                            "--top-k", "40", "--top-p", "0.95", "-n", "64", PROMPT],
                           check=False, cwd=REPO, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first, second = run(), run()
    assert len(first["token_ids"]) >= 16 and first["token_ids"] == second["token_ids"]
