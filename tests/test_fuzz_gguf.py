"""Fuzzing the GGUF loader: a damaged or hostile file loads or raises our one-line error,
never another exception. Cases that once failed are kept in tests/fuzz_corpus/ (as
mutation recipes on the sample model) and replayed first."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k4.runtime.errors import K4Error
from k4.runtime.model import open_model

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "stories260k-q4_k_m.gguf"
CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
DATA = SAMPLE.read_bytes()
HEADER_END = 16_000  # the sample's header, metadata and tensor infos end before this offset


def mutate(recipe: list) -> bytes:
    """Apply a recipe: a list of ["truncate", n] | ["flip", offset, byte] | ["u64", offset, value] | ["u32", offset, value]."""
    data = bytearray(DATA)
    for op, *args in recipe:
        if op == "truncate":
            data = data[: args[0]]
        elif op == "flip" and args[0] < len(data):
            data[args[0]] ^= args[1] or 1
        elif op in ("u64", "u32") and args[0] + 8 <= len(data):
            fmt = "<Q" if op == "u64" else "<I"
            struct.pack_into(fmt, data, args[0], args[1] % (1 << (64 if op == "u64" else 32)))
    return bytes(data)


def load(path: Path) -> None:
    """Open the file and build its tokenizer: success or our one-line error, and Python heap
    use under 4x the file size (the weights stay memory-mapped)."""
    import tracemalloc

    from k4.runtime.tokenizer import Tokenizer

    tracemalloc.start()
    try:
        mf = open_model(path)
        Tokenizer.from_model(mf)
    except K4Error as exc:
        assert "\n" not in str(exc) and str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 * len(DATA), f"peak heap {peak} bytes"


ops = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, len(DATA))),
    st.tuples(st.just("flip"), st.integers(0, HEADER_END), st.integers(1, 255)),
    st.tuples(st.just("u64"), st.integers(0, HEADER_END), st.sampled_from([0, 1, 2**31, 2**32 + 7, 2**63, 2**64 - 1])),
    st.tuples(st.just("u32"), st.integers(0, HEADER_END), st.sampled_from([0, 13, 2**31, 2**32 - 1])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ops, min_size=1, max_size=3))
def test_mutated_sample_loads_or_fails_cleanly(tmp_path, recipe):
    path = tmp_path / "m.gguf"
    path.write_bytes(mutate([list(r) for r in recipe]))
    load(path)


@pytest.mark.parametrize("case", sorted(CORPUS.glob("*.json")), ids=lambda p: p.stem)
def test_corpus(tmp_path, case):
    path = tmp_path / "m.gguf"
    path.write_bytes(mutate(json.loads(case.read_text())))
    load(path)


def test_bounded_reader_fields_match_the_gguf_package():
    """BoundedReader builds array fields' parts on demand; every field of the sample model (the
    vocabulary's string arrays, the scores and types, the scalars) has gguf.GGUFReader's parts at
    every index, negative ones included, and the same contents."""
    import numpy as np
    from gguf import GGUFReader

    from k4.runtime.gguf_reader import BoundedReader

    theirs, ours = GGUFReader(SAMPLE, "r"), BoundedReader(SAMPLE, "r")
    assert list(ours.fields) == list(theirs.fields)
    arrays = 0
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        n = len(want.parts)
        assert len(got.parts) == n and list(got.data) == list(want.data) and got.types == want.types, key
        step = max(1, n // 40)  # a few dozen indices of the 1,500-part arrays, the first and last 8 each
        for i in sorted({*range(-n, n, step), *range(min(n, 8)), *range(-min(n, 8), 0)}):
            assert np.array_equal(got.parts[i], want.parts[i]), (key, i)
        assert got.contents() == want.contents(), key
        arrays += len(want.data) > 1
    assert arrays >= 3  # tokens, scores, token types
