"""An F16 model in the shape of a `k4 synth` preset, for timing `k4 quantize` at real sizes:

    python -m tests.f16_model tinyllama-1.1b /tmp/tl-f16.gguf [--layers N]

Weights are random normals (1/sqrt(fan_in); token_embd std 1), norms near 1; metadata as
runtime.synthetic writes it, with general.file_type 1 (LLAMA_FTYPE_MOSTLY_F16). --layers keeps
only the first N layers (for a quicker profile of the same matrix shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue

from k4.runtime.model import expected_shapes
from k4.runtime.synthetic import PRESETS, vocab_from, write_metadata


def write_f16_model(preset: str, out: Path, n_layer: int = 0, seed: int = 0) -> Path:
    """Write PRESETS[preset] (n_layer > 0: that many layers) as an F16 GGUF (1-D tensors F32)."""
    cfg = PRESETS[preset].config(f"synthetic {preset} F16")
    if n_layer:
        cfg = dataclasses.replace(cfg, n_layer=n_layer)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(out), cfg.arch)
    write_metadata(w, cfg, vocab_from(None, cfg.n_vocab))
    w.kv_data[0]["general.file_type"] = GGUFValue(1, GGUFValueType.UINT32)  # in place of write_metadata's Q4_K_M
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.write_tensor_data((1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32))
            continue
        scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
        w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float16))
    w.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=[p for p in PRESETS])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    args = ap.parse_args()
    write_f16_model(args.preset, args.out, args.layers)
