"""`k4 quantize`: F32/F16/BF16 GGUF -> Q4_K_M, Q4_K_S, Q5_K_M, Q6_K or Q8_0, as llama-quantize does it.

Three steps, in execution order:

1. plan: pick each tensor's type with llama.cpp's rules for the mix (runtime/quant_mix.py:
   llama-quant.cpp llama_tensor_get_type, without importance matrix or overrides, for every
   family k4 runs: dense, phi3's fused attn_qkv, the mixtures of experts). Tensors are ordered
   as llama.cpp's loader orders them (by layer, then name), which also fixes the layer counters
   its rules use.
2. quantize: row chunks of every tensor through runtime/kquants.py on worker processes
   (runtime/quantize_pool.py), reporting progress in weights.
3. write: gguf.GGUFWriter, every metadata key of the input in its order (after
   general.architecture, which the writer puts first), then general.quantization_version = 2
   and general.file_type (LLAMA_FTYPE), the input's alignment; into a temporary file next to
   OUT that becomes OUT only when complete (exclusively, unless --force) and is removed on any
   error, Ctrl-C or SIGTERM (runtime/outfile.py).

llama.cpp's Falcon rules are not reproduced (k4 does not run Falcon).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from .errors import UnsupportedModelError, UsageError
from .model import ModelFile, open_model
from .outfile import check_output, partial_output
from .quant_mix import Mix, choose_types, get_mix, llama_order
from .quantize_pool import encoded_chunks, start_pool, worker_count

T = GGMLQuantizationType

GGML_QNT_VERSION = 2  # ggml.h: the quantization format version llama.cpp writes
INPUT_TYPES = (T.F32, T.F16, T.BF16)  # what the Hugging Face converters write

Progress = Callable[[int, int, str], None]  # (weights done, weights in all, tensor name)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the output: name, numpy shape, input type and output type."""

    name: str
    shape: tuple[int, ...]
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def src_bytes(self) -> int:
        return _n_bytes(self.shape, self.src_type)

    @property
    def dst_bytes(self) -> int:
        return _n_bytes(self.shape, self.dst_type)


@dataclass(frozen=True)
class QuantPlan:
    """What `quantize_model` will write: the mix and every tensor in output order.

    src_bytes / dst_bytes: tensor data in bytes, before and after; bpw: bits per weight after.
    """

    mix: Mix
    tensors: tuple[TensorPlan, ...]

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def src_bytes(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def dst_bytes(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def bpw(self) -> float:
        return 8.0 * self.dst_bytes / max(self.n_elements, 1)


def _n_bytes(shape: Sequence[int], ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(shape)) // block * size


def plan_quantization(mf: ModelFile, mix: Mix) -> QuantPlan:
    """The per-tensor plan for quantizing `mf` to `mix`, tensors in llama.cpp's order.

    Raises UnsupportedModelError when a tensor to be quantized is not F32, F16 or BF16
    (k4 does not re-quantize quantized models).
    """
    cfg = mf.config
    assert cfg is not None
    names = llama_order(list(mf.tensors))
    shapes = [(n, mf.tensors[n].shape) for n in names]
    types = choose_types(shapes, mix, cfg.arch, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.n_expert)
    plans = []
    for (name, shape), new in zip(shapes, types):
        src = mf.tensors[name].ggml_type
        if new is not None and src not in INPUT_TYPES:
            raise UnsupportedModelError(
                f"{mf.path}: tensor {name!r} is already {src.name}; k4 quantize reads F32, F16 or BF16 models "
                "(convert the original weights with llama.cpp's convert_hf_to_gguf.py)"
            )
        plans.append(TensorPlan(name, shape, src, src if new is None else new))
    return QuantPlan(mix, tuple(plans))


def copy_metadata(mf: ModelFile, writer: GGUFWriter, skip: set[str] = frozenset(), replace: dict[str, object] | None = None) -> None:
    """Add every key/value of `mf` to `writer` in file order, except GGUF.* and `skip`; keys in
    `replace` keep their place and type with the new value.

    Values are copied raw (strings as bytes, so any encoding survives). Empty arrays are left
    out: the gguf package cannot write them, and no converter does. Raises
    UnsupportedModelError for nested arrays.
    """
    replace = replace or {}
    for key, field in mf.reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        vtype = field.types[0]
        if key in replace:
            writer.add_key_value(key, replace[key], vtype)
        elif vtype == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise UnsupportedModelError(f"{mf.path}: metadata key {key!r} is a nested array, which k4 quantize cannot copy")
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [v for i in field.data for v in field.parts[i].tolist()]
            if value:
                writer.add_key_value(key, value, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[-1]), vtype)
        else:
            writer.add_key_value(key, field.parts[-1].tolist()[0], vtype)


def _encoded_tensors(mf: ModelFile, plan: QuantPlan, pool: ProcessPoolExecutor | None, depth: int, progress: Progress | None):
    """Yield each tensor's output bytes (rows, row bytes) uint8 in plan order; report progress in weights."""
    total, done = plan.n_elements, 0
    results = encoded_chunks(mf, plan, pool, depth)
    for tp in plan.tensors:
        raw = mf.tensors[tp.name].raw_bytes()  # (rows, row bytes) memory-mapped
        if tp.dst_type == tp.src_type:
            done += tp.n_elements
            if progress:
                progress(done, total, tp.name)
            yield raw
            continue
        data = np.empty((raw.shape[0], _n_bytes(tp.shape[-1:], tp.dst_type)), dtype=np.uint8)
        row = 0
        while row < raw.shape[0]:
            encoded = next(results)
            data[row : row + encoded.shape[0]] = encoded
            row += encoded.shape[0]
            done += encoded.shape[0] * tp.shape[-1]
            if progress:
                progress(done, total, tp.name)
        yield data


def write_quantized(mf: ModelFile, plan: QuantPlan, out: Path, progress: Progress | None = None, threads: int = 0,
                    force: bool = False) -> None:
    """Quantize `mf` by `plan` and write the GGUF to `out` through runtime.outfile.partial_output
    (a unique temporary file, published exclusively unless force; removed on any error, Ctrl-C or
    SIGTERM). threads: worker processes, as
    llama-quantize's nthread (0: one per CPU core; 1: all in this process). Workers start from
    a forkserver, so a script that calls this with threads != 1 needs the
    `if __name__ == "__main__":` guard that multiprocessing asks for.

    Raises ModelFileError (NaN/inf weights), UsageError (see partial_output), OSError (the file system).
    """
    with partial_output(out, force) as tmp:
        _write(mf, plan, tmp, progress, threads)


def _write(mf: ModelFile, plan: QuantPlan, tmp: Path, progress: Progress | None, threads: int) -> None:
    writer = GGUFWriter(tmp, mf.arch)
    writer.data_alignment = int(mf.reader.alignment)
    copy_metadata(mf, writer, {"general.architecture", "general.quantization_version", "general.file_type"})
    writer.add_quantization_version(GGML_QNT_VERSION)
    writer.add_file_type(plan.mix.file_type)
    for tp in plan.tensors:
        byte_shape = (*tp.shape[:-1], _n_bytes(tp.shape[-1:], tp.dst_type))  # the writer maps it back to tp.shape
        writer.add_tensor_info(tp.name, byte_shape, np.dtype(np.uint8), tp.dst_bytes, raw_dtype=tp.dst_type)
    workers = worker_count(threads)
    pool = start_pool(workers)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in _encoded_tensors(mf, plan, pool, 4 * workers, progress):
            writer.write_tensor_data(data)
        writer.fout[0].flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
    except BaseException:
        if pool:
            pool.shutdown(wait=False, cancel_futures=True)
        writer.close()
        raise
    if pool:
        pool.shutdown()


def quantize_model(
    src: str | os.PathLike,
    out: str | os.PathLike,
    mix_name: str,
    force: bool = False,
    progress: Progress | None = None,
    threads: int = 0,
) -> QuantPlan:
    """Quantize the GGUF at `src` to the mix `mix_name` and write it to `out`. Returns the plan.

    Raises UsageError (unknown mix; `out` exists and force is false, is `src`, is a folder, or
    cannot be written), ModelFileError / UnsupportedModelError (bad input, not F32/F16/BF16).
    """
    mix = get_mix(mix_name)
    out = Path(out)
    if Path(src).resolve() == out.resolve():
        raise UsageError(f"{out} is the input file; write the quantized model to another path")
    check_output(out, force)
    mf = open_model(src)
    plan = plan_quantization(mf, mix)
    try:
        write_quantized(mf, plan, out, progress, threads, force)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}; check the folder's permissions and free space") from None
    return plan
