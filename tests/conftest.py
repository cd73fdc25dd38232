"""Shared test setup: the test data folder (tests/data, provenance in its README) and the
`cuda` marker's skip rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from k4.runtime.backend import cuda_available

DATA = Path(__file__).resolve().parent / "data"


HAS_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and CuPy")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data() -> Path:
    """tests/data: models, llama.cpp goldens, vocab suites and chat templates."""
    return DATA
