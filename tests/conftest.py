"""Shared test setup: the test data folder (tests/data, provenance in its README), the
`cuda` marker's skip rule, and the fixtures several `cuda` test modules share.

Without a GPU, `cuda` tests are skipped. With K4_REQUIRE_GPU=1 (set it on GPU machines) a
would-be skip is a failure instead, so a broken CuPy or driver cannot pass as "no GPU".
cuda_available() raises rather than answers False for anything but "CuPy not installed" or
"no device"; that exception is kept and reported by every `cuda` test.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

import pytest

from k4.runtime.backend import cuda_available

DATA = Path(__file__).resolve().parent / "data"
REQUIRE_GPU = os.environ.get("K4_REQUIRE_GPU", "0") == "1"


def _probe() -> tuple[bool, str]:
    try:
        return cuda_available(), "needs an NVIDIA GPU and CuPy"
    except Exception as exc:  # a broken CuPy or driver: say what it was
        return False, f"CuPy/CUDA is broken: {type(exc).__name__}: {exc}"


HAS_GPU, NO_GPU_REASON = _probe()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    for item in items:
        if "cuda" in item.keywords:
            if REQUIRE_GPU:
                item.add_marker(pytest.mark.usefixtures("_gpu_required"))
            else:
                item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))


@pytest.fixture
def _gpu_required():
    pytest.fail(f"K4_REQUIRE_GPU=1 but {NO_GPU_REASON}", pytrace=False)


@pytest.fixture(scope="session")
def data() -> Path:
    """tests/data: models, llama.cpp goldens, oracles, vocab suites and chat templates."""
    return DATA


@pytest.fixture(scope="module")
def ops():
    """The CUDA kernel launchers (runtime/cuda/ops.py) with tensor-core prefill attention, for
    kernel tests; the module's tests share one."""
    from k4.runtime.cuda.ops import Ops
    from k4.runtime.trace import Trace

    return Ops(Trace())


@pytest.fixture
def rng(request):
    """A generator seeded by the test's name: fresh inputs per test, the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---- the CUDA backend tests (test_cuda_backend, test_cuda_runner, test_cuda_switches) -------------

@pytest.fixture
def unset_backend_flags(monkeypatch):
    """Every switch the CUDA backend tests vary (tests/cuda_backend_cases.py ALL_FLAGS) unset: each
    test starts from the defaults and sets only what it varies."""
    from tests.cuda_backend_cases import ALL_FLAGS

    for name in ALL_FLAGS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def stories(data):
    """(ModelFile, Tokenizer, CudaBackend of n_ctx 256) of tests/data/models/stories260K.gguf (F32);
    the module's tests share the backend (each resets it)."""
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer
    from tests.cuda_backend_cases import cuda

    mf = open_model(data / "models" / "stories260K.gguf")
    return mf, Tokenizer.from_model(mf), cuda(mf, 256)


@pytest.fixture(scope="module")
def stories_q4(data):
    """As `stories`, of stories260K-pad-q4_k_m.gguf (Q4_K_M)."""
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer
    from tests.cuda_backend_cases import cuda

    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    return mf, Tokenizer.from_model(mf), cuda(mf, 256)


@pytest.fixture
def tiny_model(data, tmp_path, monkeypatch):
    """Write a tiny random model of one ARCH_CASES entry (tests/cuda_backend_cases.py; blocks by
    tests/quant_blocks.py): make(case) -> its ModelFile."""
    from k4.runtime.model import open_model
    from tests import tiny
    from tests.cuda_backend_cases import ARCH_CASES
    from tests.quant_blocks import blocks_like

    monkeypatch.setattr(tiny, "quantize", blocks_like)

    def make(case: str):
        arch, ttype, over = ARCH_CASES[case]
        cfg = tiny.tiny_config(arch, **over)
        path = tiny.write_tiny(tmp_path / f"{case}.gguf", data / "models" / "stories260K.gguf", cfg, ttype, seed=7)
        return open_model(path)

    return make
