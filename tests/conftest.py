"""Shared test setup: where ../shared is (K4_SHARED), and the `cuda` marker's skip rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.backend import cuda_available

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("K4_SHARED", REPO.parent / "shared")).resolve()


HAS_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and CuPy")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"shared data not found at {SHARED}; set K4_SHARED")
    return SHARED
