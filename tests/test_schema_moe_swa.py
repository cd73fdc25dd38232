"""The metadata schema's rules for mixture-of-experts and sliding-window files (runtime/schema.py),
on tiny qwen3moe and gemma3 files rewritten key by key: a top-k above the expert count and a
sliding-window period out of range are refused with a message naming the key, the value and what
was expected; the expert width defaults as llama.cpp's loader derives it when a file leaves it
out. Each test was checked against the mutants of those rules it targets."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from k4.runtime.errors import ModelFileError
from k4.runtime.model import open_model
from tests.hostile.gguf_bytes import Model
from tiny import tiny_config, write_tiny


def _tiny(tmp_path, data, arch: str, **over):
    cfg = tiny_config(arch, **over)
    return write_tiny(tmp_path / f"{arch}.gguf", data / "models" / "stories260K.gguf", cfg, T.F32, seed=3)


def _rewritten(tmp_path, source, edit) -> Path:
    path = tmp_path / "edited.gguf"
    path.write_bytes(edit(Model.read(source)).to_bytes())
    return path


MOE = dict(has_qk_norm=True, n_expert=8, n_expert_used=2, n_ff_exp=32)


def test_top_k_above_the_expert_count_is_refused(tmp_path, data):
    src = _tiny(tmp_path, data, "qwen3moe", **MOE)
    path = _rewritten(tmp_path, src, lambda m: m.set("qwen3moe.expert_used_count", V.UINT32, 9))
    with pytest.raises(ModelFileError) as info:
        open_model(path)
    assert str(info.value) == f"{path}: metadata key 'qwen3moe.expert_used_count' = 9; expected at most expert_count (8)"
    path = _rewritten(tmp_path, src, lambda m: m.set("qwen3moe.expert_used_count", V.UINT32, 8))
    assert open_model(path).config.n_expert_used == 8  # all of them is allowed


def test_expert_widths_default_as_llama_cpp_loads_them(tmp_path, data):
    """Without expert_feed_forward_length the expert width is feed_forward_length / top-k; without
    both the file is incomplete."""
    src = _tiny(tmp_path, data, "qwen3moe", **MOE)
    cfg = open_model(src).config
    path = _rewritten(tmp_path, src, lambda m: m.drop("qwen3moe.expert_feed_forward_length")
                      .set("qwen3moe.feed_forward_length", V.UINT32, 2 * 32))
    assert open_model(path).config.n_ff_exp == 32 == cfg.n_ff_exp  # 64 / 2
    path = _rewritten(tmp_path, src, lambda m: m.drop("qwen3moe.expert_feed_forward_length").drop("qwen3moe.feed_forward_length"))
    with pytest.raises(ModelFileError, match="'qwen3moe.expert_feed_forward_length' is missing"):
        open_model(path)


@pytest.mark.parametrize("period", [0, 99])
def test_a_sliding_window_period_out_of_range_is_refused(tmp_path, data, period):
    from tests.test_gemma import gemma_tiny

    cfg = gemma_tiny("gemma3", {"attention.sliding_window": 5, "attention.sliding_window_pattern": (True, False, True, True)})
    src = write_tiny(tmp_path / "gemma3.gguf", data / "models" / "stories260K.gguf", cfg, T.F32)
    n_layer = open_model(src).config.n_layer
    path = _rewritten(tmp_path, src, lambda m: m.set("gemma3.attention.sliding_window_pattern", V.UINT32, period))
    with pytest.raises(ModelFileError) as info:
        open_model(path)
    assert f"metadata key 'gemma3.attention.sliding_window_pattern' = {period}" in str(info.value)
    assert f"expected a period in 1..{n_layer} or an array of {n_layer} booleans, one per layer" in str(info.value)
    path = _rewritten(tmp_path, src, lambda m: m.set("gemma3.attention.sliding_window_pattern", V.UINT32, n_layer))
    open_model(path)  # n_layer itself is a period
