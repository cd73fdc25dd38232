"""Make samples/stories260k-q4_k_m.gguf from stories260K.gguf with k4's own code.

    python samples/make_sample.py [--src stories260K.gguf] [--out samples/stories260k-q4_k_m.gguf]

Two steps:

1. pad: stories260K (n_embd 64, 8 heads of 8 / 4 kv heads, n_ff 172) is zero-padded so every
   matrix row is 256 long and Q4_K applies to every matrix: n_embd 256, 32 heads of 8,
   16 kv heads, n_ff 256. Each weight keeps its place at the start of every axis and the new
   rows and columns are zero, so the padded model computes the same function:
   - zero embedding columns stay zero through every residual add;
   - RMSNorm over 256 values of which 192 are zero has mean square 1/4 of the original, so
     with eps / 4 the normalized values are twice the original: norm weights are halved;
   - heads 8..31 have zero queries and read kv heads 4..15 (n_head / n_head_kv is still 2),
     whose values are zero, so they add nothing; heads 0..7 still read kv heads 0..3;
   - padded feed-forward units have zero gate and up rows: SiLU(0) * 0 = 0.
   The context length is set to 512, the length stories260K was trained on, and the separator
   and padding token ids, which are unset (0xFFFFFFFF), are dropped.
2. quantize: runtime.quantize.quantize_model (what `k4 quantize` runs) to Q4_K_M.

The result is byte for byte the file llama.cpp's llama-quantize makes from the same padded
model (tests/test_sample.py checks the tensors against the committed sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

REPO = Path(__file__).resolve().parents[1]
from k4.runtime.model import expected_shapes, open_model
from k4.runtime.quantize import copy_metadata, quantize_model

SAMPLE = REPO / "samples" / "stories260k-q4_k_m.gguf"
PADDED = dict(n_embd=256, n_head=32, n_head_kv=16, n_ff=256)  # every row a multiple of QK_K = 256
N_CTX_TRAIN = 512  # tokens: stories260K's training sequence length
UNSET_TOKEN_ID = 0xFFFFFFFF
NAME = "stories260K (zero-padded to 256)"


def default_source() -> Path:
    """stories260K.gguf as the tests keep it (tests/data/models, provenance in tests/data/README.md)."""
    return REPO / "tests" / "data" / "models" / "stories260K.gguf"


def pad_model(src: Path, dst: Path) -> None:
    """Write the zero-padded F32 copy of the llama model at `src` to `dst` (see the module doc).

    Tensor shapes come from runtime.model.expected_shapes for the padded ModelConfig; every
    tensor is zero-padded at the end of each axis, norm weights are halved, and
    {arch}.attention.layer_norm_rms_epsilon is divided by 4 (all in float32).
    """
    mf = open_model(src)
    cfg = mf.config
    padded = dataclasses.replace(cfg, **PADDED)
    shapes = expected_shapes(padded)
    arch = cfg.arch
    changed = {
        f"{arch}.context_length": N_CTX_TRAIN,
        f"{arch}.embedding_length": padded.n_embd,
        f"{arch}.feed_forward_length": padded.n_ff,
        f"{arch}.attention.head_count": padded.n_head,
        f"{arch}.attention.head_count_kv": padded.n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": float(np.float32(cfg.rms_eps) / np.float32(4)),
    }
    unset = {k for k in mf.reader.fields if k.endswith("_token_id") and mf.meta(k) == UNSET_TOKEN_ID}
    writer = GGUFWriter(dst, arch)
    copy_metadata(mf, writer, {"general.architecture", *changed, *unset}, replace={"general.name": NAME})
    for key in (k for k in mf.reader.fields if k in changed):
        writer.add_key_value(key, changed[key], mf.reader.fields[key].types[0])
    for name, t in mf.tensors.items():
        x = np.asarray(t.raw, dtype=np.float32).reshape(t.shape)
        if name.endswith("norm.weight"):
            x = x * np.float32(0.5)
        out = np.zeros(shapes[name], dtype=np.float32)
        out[tuple(slice(0, n) for n in x.shape)] = x
        writer.add_tensor(name, out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_sample(src: Path, out: Path) -> None:
    """Pad `src` (into a temporary folder) and quantize it to Q4_K_M at `out` (overwritten)."""
    with tempfile.TemporaryDirectory() as tmp:
        padded = Path(tmp) / "stories260K-pad-f32.gguf"
        pad_model(src, padded)
        quantize_model(padded, out, "Q4_K_M", force=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=default_source(), help="stories260K.gguf (F32)")
    parser.add_argument("--out", type=Path, default=SAMPLE, help="where to write the Q4_K_M sample")
    args = parser.parse_args()
    make_sample(args.src, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
