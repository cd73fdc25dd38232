"""The numpy backend's memory: weights stay in their GGUF types (peak RSS within 1.5x the file
plus the KV cache), a model that cannot fit is refused up front, MemoryError is one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime import hostmem, weights
from k4.runtime.backend import make_backend
from k4.runtime.errors import OutOfMemoryError
from k4.runtime.model import SAMPLE_MODEL, expected_shapes, open_model
from k4.runtime.reference import NumpyBackend
from k4.runtime.synthetic import PRESETS, Preset, write_synthetic

runner = CliRunner()

# 4 layers of a 1,024-wide llama in Q4_K_M: a file of 41 MiB whose float32 weights take 260 MiB
MEM_PRESET = Preset("llama", 8192, 1024, 4, 8, 8, 2816, 2048, 10000.0, 1e-5)

PEAK_SCRIPT = r"""
import json, sys
import numpy as np
from k4.runtime.model import open_model
from k4.runtime.reference import NumpyBackend

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

mf = open_model(sys.argv[1])
np.ones((64, 1024), np.float32) @ np.ones((1024, 1024), np.float32)  # BLAS buffers belong to the baseline
base = status("VmRSS:")
be = NumpyBackend(mf, 64)
be.eval([1, 2, 3, 4])
be.eval([5])
print(json.dumps({"base": base, "peak": status("VmHWM:"), "cached": be.cached,
                  "kv": be.k_cache.nbytes + be.v_cache.nbytes,
                  "f32": sum(4 * t.n_elements for t in mf.tensors.values())}))
"""


@pytest.fixture(scope="module")
def mem_model(tmp_path_factory):
    PRESETS["mem-test"] = MEM_PRESET
    try:
        return write_synthetic("mem-test", tmp_path_factory.mktemp("mem") / "mem-test.gguf")
    finally:
        del PRESETS["mem-test"]


def test_peak_rss_stays_within_one_and_a_half_times_the_file(mem_model):
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(mem_model)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    size = mem_model.stat().st_size
    assert not r["cached"] and r["f32"] > 5 * size  # float32 weights would break the bound five times over
    assert r["peak"] - r["base"] <= 1.5 * size + r["kv"], (r, size)


def test_decode_without_the_cache_is_bit_identical(data):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    kept, on_use = NumpyBackend(mf, 32), NumpyBackend(mf, 32, cache_bytes=0)
    assert kept.cached and not on_use.cached and all(m.f32 is None for m in on_use.matrices())
    assert all(m.f32 is not None and m.f32.dtype == np.float32 for m in kept.matrices())  # kept: dequantized once at load
    ids = [1, 403, 407, 261, 378, 12, 88]
    np.testing.assert_array_equal(on_use.eval(ids, all_logits=True), kept.eval(ids, all_logits=True))
    np.testing.assert_array_equal(on_use.eval([99]), kept.eval([99]))


def test_row_blocks_compute_the_same_function(data):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    blocked = NumpyBackend(mf, 32, cache_bytes=0, block_bytes=64 * 256 * 4)  # 64 rows of 256 at a time
    assert blocked.output.block_rows == 64 and blocked.layers[0].wq.block_rows == 64
    ids = [1, 403, 407, 261, 378, 12, 88]
    np.testing.assert_allclose(blocked.eval(ids, all_logits=True), NumpyBackend(mf, 32).eval(ids, all_logits=True), rtol=0, atol=1e-4)


def test_embedding_dequantizes_only_the_rows_it_needs(data, monkeypatch):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    t = mf.tensor("token_embd.weight")
    m = weights.Matrix(t, block_bytes=2**20)
    seen = []
    real = weights.dequantize
    monkeypatch.setattr(weights, "dequantize", lambda raw, qtype: seen.append(raw.shape) or real(raw, qtype))
    ids = np.array([5, 300, 5, 17])
    got = m.rows(ids)
    assert seen == [(4, t.raw_bytes().shape[1])]
    np.testing.assert_array_equal(got, weights.dequantize_tensor(t)[ids])


def test_load_progress_counts_the_bytes_of_every_tensor():
    calls = []
    mf = open_model(SAMPLE_MODEL)
    make_backend(mf, "numpy", 64, progress=lambda done, total: calls.append((done, total)))
    total = sum(mf.tensor(n).n_bytes for n in expected_shapes(mf.config))
    assert len(calls) == len(expected_shapes(mf.config))
    assert calls[-1] == (total, total) and total > 0.95 * mf.file_size
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:]))


def test_a_model_that_does_not_fit_is_refused_with_both_sizes(data):
    mf = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    cfg = mf.config
    kv = 2 * 4 * cfg.n_layer * 4096 * cfg.n_head_kv * cfg.head_dim
    with pytest.raises(OutOfMemoryError) as exc:
        NumpyBackend(mf, 4096, mem_available=3 * 2**20)
    msg = str(exc.value)
    m = re.fullmatch(r"stories260K-pad-q4_k_m\.gguf on the numpy backend needs ([\d,]+) MiB of RAM \(weights 1 MiB, "
                     r"dequantized (\d+) MiB, KV cache (\d+) MiB\) but 3 MiB is available; free memory, lower --ctx-size "
                     r"or use a smaller model", msg)
    assert m, msg
    assert int(m.group(3)) == round(kv / 2**20)
    NumpyBackend(mf, 4096, mem_available=2**40)  # the same model loads when the memory is there


def test_cli_refuses_a_model_larger_than_the_free_memory(monkeypatch):
    monkeypatch.setattr(hostmem, "available_ram", lambda: 2 * 2**20)
    r = runner.invoke(app, ["run", "--backend", "numpy", "-n", "4", "Once upon a time"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: stories260k-q4_k_m.gguf on the numpy backend needs ")
    assert "but 2 MiB is available" in lines[0]


@pytest.mark.parametrize("where", ["keep", "product"])  # at load (dequantizing), during generation
def test_memory_error_becomes_one_line_and_exit_2(monkeypatch, where):
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 5.1 GiB for an array with shape (32000, 2048) and data type float32")

    monkeypatch.setattr(weights.Matrix, where, no_memory)
    r = runner.invoke(app, ["run", "--backend", "numpy", "-n", "4", "Once upon a time"])
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: ran out of memory (RAM); free memory, lower --ctx-size or use a smaller model"


def test_available_ram_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684000 kB\nMemFree:        1000 kB\nMemAvailable:   2000000 kB\n")
    no_cgroup = tmp_path / "none"
    assert hostmem.available_ram(meminfo, no_cgroup) == 2000000 * 1024
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("1073741824\n")
    (cg / "memory.current").write_text("536870912\n")
    (cg / "memory.stat").write_text("anon 400000000\ninactive_file 100000000\n")
    assert hostmem.available_ram(meminfo, cg) == 1073741824 - 536870912 + 100000000
    (cg / "memory.max").write_text("max\n")
    assert hostmem.available_ram(meminfo, cg) == 2000000 * 1024
