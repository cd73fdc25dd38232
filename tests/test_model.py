"""GGUF opening and validation: good files give the right config, bad ones one clear line."""

from __future__ import annotations

import shutil

import pytest
from gguf import GGMLQuantizationType as T
from typer.testing import CliRunner

from k4.cli.app import app
from k4.runtime.errors import ModelFileError, UnsupportedModelError
from k4.runtime.model import open_model
from tiny import tiny_config, write_tiny

runner = CliRunner()


def test_config_of_real_models(data):
    cfg = open_model(data / "models" / "stories260K.gguf").config
    assert (cfg.arch, cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (
        "llama", 512, 64, 5, 8, 4, 8, 172)
    assert not cfg.rope_neox and not cfg.tied_embeddings and cfg.n_gqa == 2
    pad = open_model(data / "models" / "stories260K-pad-q4_k_m.gguf")
    assert (pad.config.n_embd, pad.config.n_head, pad.config.n_head_kv, pad.config.head_dim) == (256, 32, 16, 8)
    types = sorted({t.type_name for t in pad.tensors.values()})
    assert types == ["F32", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_flags_per_arch(tmp_path, data, arch):
    p = write_tiny(tmp_path / "m.gguf", data / "models" / "stories260K.gguf", tiny_config(arch, tied_embeddings=arch == "qwen3"))
    cfg = open_model(p).config
    assert cfg.rope_neox == (arch != "llama")
    assert cfg.has_qkv_bias == (arch == "qwen2")
    assert cfg.has_qk_norm == (arch == "qwen3")
    assert cfg.tied_embeddings == (arch == "qwen3")


def _bad_files(tmp_path, data):
    vocab = data / "models" / "stories260K.gguf"
    sample = data / "models" / "stories260K-pad-q4_k_m.gguf"
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model\n")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(sample.read_bytes()[: int(sample.stat().st_size * 0.6)])
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(sample.read_bytes()[:200])
    arch = write_tiny(tmp_path / "arch.gguf", vocab, tiny_config("mamba"))
    qtype = write_tiny(tmp_path / "q4_1.gguf", vocab, tiny_config(), matrix_type=T.Q4_1)
    missing = write_tiny(tmp_path / "missing.gguf", vocab, tiny_config(), skip=("blk.1.ffn_up.weight",))
    return {
        "absent": (tmp_path / "nope.gguf", "no such file"),
        "not_gguf": (text, "not a GGUF file"),
        "truncated": (truncated, "truncated"),
        "header_cut": (header_cut, "truncated GGUF"),
        "arch": (arch, "architecture 'mamba' is not supported"),
        "qtype": (qtype, "has type Q4_1, which k4 does not support"),
        "missing": (missing, "tensor 'blk.1.ffn_up.weight' is missing"),
    }


CASES = ["absent", "not_gguf", "truncated", "header_cut", "arch", "qtype", "missing"]


@pytest.mark.parametrize("case", CASES)
def test_bad_file_raises_our_error(tmp_path, data, case):
    path, message = _bad_files(tmp_path, data)[case]
    with pytest.raises((ModelFileError, UnsupportedModelError)) as info:
        open_model(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("command", ["info", "run"])
@pytest.mark.parametrize("case", CASES)
def test_bad_file_cli_one_line_exit_2(tmp_path, data, case, command):
    path, message = _bad_files(tmp_path, data)[case]
    args = [command, "-m", str(path)] + (["hi", "--backend", "numpy"] if command == "run" else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.output


def test_sample_file_untouched_by_failed_load(tmp_path, data):
    src = data / "models" / "stories260K-pad-q4_k_m.gguf"
    copy = tmp_path / "m.gguf"
    shutil.copy(src, copy)
    open_model(copy)
    assert copy.read_bytes() == src.read_bytes()


def _tensor_info_offsets(path, name):
    """Byte positions of one tensor-info record's fields (gguf.md: name, n_dims, dims, type, offset)."""
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    base, n, nd = int(t.field.offset), len(name.encode()), int(t.field.parts[2][0])
    dims = base + 8 + n + 4
    return {"name": base + 8, "n_dims": dims - 4, "dims": dims, "type": dims + 8 * nd, "offset": dims + 8 * nd + 4}


@pytest.mark.parametrize("field, value, needle", [
    ("name", b"blk.0.attn_q.weight", "duplicated tensor"),
    ("offset", 10**12, "truncated GGUF"),
    ("offset", "+1", "not aligned to 32 bytes"),
    ("dims", 200, "not a multiple of Q4_K block size"),
    ("type", 99, "not a valid GGMLQuantizationType"),
    ("n_dims", 7, "damaged or truncated GGUF"),
])
def test_hostile_tensor_infos(tmp_path, data, field, value, needle):
    import struct

    src = data / "models" / "stories260K-pad-q4_k_m.gguf"
    pos = _tensor_info_offsets(src, "blk.0.attn_k.weight")[field]
    data = bytearray(src.read_bytes())
    if isinstance(value, bytes):
        data[pos : pos + len(value)] = value
    elif value == "+1":
        struct.pack_into("<Q", data, pos, struct.unpack_from("<Q", data, pos)[0] + 1)
    else:
        struct.pack_into("<I" if field in ("type", "n_dims") else "<Q", data, pos, value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as info:
        open_model(bad)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_reader_on_a_plain_view_parses_what_gguf_parses(data):
    """open_model's reader (GGUFReader on an ndarray view of the memory map, for speed) gives the
    same metadata, tensor infos, offsets and bytes as gguf's GGUFReader on the same file."""
    import numpy as np
    from gguf import GGUFReader

    path = data / "models" / "stories260K-pad-q4_k_m.gguf"
    mf, ref = open_model(path), GGUFReader(path, "r")
    assert type(mf.reader.data) is np.ndarray
    assert list(mf.reader.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        if not name.startswith("GGUF."):
            assert mf.meta(name) == field.contents(), name
    assert [(t.name, int(t.data_offset), t.shape.tolist()) for t in mf.reader.tensors] == \
           [(t.name, int(t.data_offset), t.shape.tolist()) for t in ref.tensors]
    for t in ref.tensors:
        mine = mf.tensors[t.name]
        assert mine.file_offset == int(t.data_offset)
        assert np.array_equal(mine.raw_bytes().reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_optional_tensors_follow_the_family_rule():
    """q/k/v biases: read when present for llama (some llama-architecture models carry them),
    always for qwen2, never for qwen3; one attn_qkv tensor: phi3's when present, never llama's."""
    from k4.runtime.arch import ARCHITECTURES as A

    biased, plain = {"blk.0.attn_q.bias", "blk.0.attn_q.weight"}, {"blk.0.attn_q.weight"}
    assert A["llama"].has_qkv_bias(biased) and not A["llama"].has_qkv_bias(plain)
    assert A["qwen2"].has_qkv_bias(plain) and not A["qwen3"].has_qkv_bias(biased)
    fused = {"blk.0.attn_qkv.weight"}
    assert A["phi3"].has_fused_qkv(fused) and not A["phi3"].has_fused_qkv(plain)
    assert not A["llama"].has_fused_qkv(fused)


def test_rope_scaling_from_the_older_linear_key_and_from_the_type():
    """rope_scaling_fields: rope.scale_linear alone (files older than rope.scaling.*) is linear scaling
    by that factor; rope.scaling.type with its factor wins over it; no scaling key, or type none,
    is factor 1; phi3's rope_factors_long tensor makes it longrope; an unknown type is refused."""
    from types import SimpleNamespace

    from k4.runtime.model import rope_scaling_fields

    mf = SimpleNamespace(path="m.gguf", tensors={})
    got = rope_scaling_fields(mf, {"rope.scale_linear": 4.0})
    assert (got["rope_scaling"], got["rope_scale"]) == ("linear", 4.0)
    got = rope_scaling_fields(mf, {"rope.scale_linear": 4.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 8.0,
                                   "rope.scaling.original_context_length": 4096})
    assert (got["rope_scaling"], got["rope_scale"], got["rope_orig_ctx"]) == ("yarn", 8.0, 4096)
    for v in ({}, {"rope.scaling.type": "none", "rope.scaling.factor": 2.0}):
        got = rope_scaling_fields(mf, v)
        assert (got["rope_scaling"], got["rope_scale"]) == ("none", 1.0)
    got = rope_scaling_fields(SimpleNamespace(path="m.gguf", tensors={"rope_factors_long.weight": None}), {})
    assert got["rope_scaling"] == "longrope"
    with pytest.raises(UnsupportedModelError, match="'su' is not supported"):
        rope_scaling_fields(mf, {"rope.scaling.type": "su"})


def test_optional_keys_take_their_defaults(tmp_path, data, monkeypatch):
    """A file without context_length, the RMSNorm epsilon or the RoPE base: 2,048 tokens of training
    context, eps 1e-5 and base 10,000 (llama.cpp's default base)."""
    from gguf import GGUFWriter

    dropped = (".context_length", ".attention.layer_norm_rms_epsilon", ".rope.freq_base")
    for method in ("add_uint32", "add_float32"):
        real = getattr(GGUFWriter, method)
        monkeypatch.setattr(GGUFWriter, method, lambda self, key, value, real=real: None if key.endswith(dropped)
                            else real(self, key, value))
    path = write_tiny(tmp_path / "m.gguf", data / "models" / "stories260K.gguf",
                      tiny_config("llama", n_ctx_train=64, rms_eps=1e-6, rope_freq_base=5e5))
    cfg = open_model(path).config
    assert (cfg.n_ctx_train, cfg.rms_eps, cfg.rope_freq_base) == (2048, 1e-5, 10000.0)


def test_the_header_takes_gguf_versions_2_and_3_only(tmp_path):
    """_check_header: a file of exactly the 24-byte header passes for versions 2 and 3; versions 1
    and 4 and a shorter file are refused with their reason."""
    import struct

    from k4.runtime.model import _check_header

    for version, ok in ((2, True), (3, True), (1, False), (4, False)):
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<I", version) + bytes(16))
        if ok:
            _check_header(path)
        else:
            with pytest.raises(ModelFileError, match=f"unsupported GGUF version {version}"):
                _check_header(path)
    (tmp_path / "short.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(15))
    with pytest.raises(ModelFileError, match="23 bytes, the header alone is 24"):
        _check_header(tmp_path / "short.gguf")
