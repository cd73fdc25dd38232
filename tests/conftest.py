"""Shared test setup: the test data folder (tests/data, provenance in its README) and the
`cuda` marker's skip rule.

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

    return Ops(Trace(), mma=True)


@pytest.fixture
def rng(request):
    """A generator seeded by the test's name: fresh inputs per test, the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
