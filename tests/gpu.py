"""CuPy for `cuda` test modules: the module, or a skip without it (a failure when
K4_REQUIRE_GPU=1, as conftest.py turns every would-be skip of a `cuda` test)."""

from __future__ import annotations

import os

import pytest


def cupy_or_skip():
    """Import and return cupy; skip the module when it is missing, or fail with K4_REQUIRE_GPU=1."""
    try:
        import cupy
    except ImportError as exc:
        if os.environ.get("K4_REQUIRE_GPU", "0") == "1":
            pytest.fail(f"K4_REQUIRE_GPU=1 but CuPy does not import: {exc}", pytrace=False)
        pytest.skip("needs CuPy", allow_module_level=True)
    return cupy
