"""The parameter lists of the kernels in a kernels_cu source, read from the source text, and the
checks tests/dry_run.py makes of each launch the CUDA backend records (tests/cupy_stub.py).

A kernel's parameters are what cuLaunchKernel reads from the argument list: one value per
parameter, of the parameter's size. A launch passing one argument too few, or a float where the
kernel reads an int, is not refused by the driver; the kernel reads garbage. These checks are the
CPU's only way to see such a launch:
- the argument count equals the parameter count;
- each argument's kind fits its parameter: a device array or a null pointer (np.uint64) for a
  pointer, np.int32 for int, np.float32 for float, np.int64 for i64 / long long;
- the geometry CUDA would refuse: at most 1,024 threads a block, grid y and z below 65,536, shared
  memory within sm_90's 227 KB opt-in and within what the kernel was allowed (48 KB unless
  launch.allow_shared raised it), a cluster of 2..8 blocks dividing grid x.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import numpy as np

# a kernel's head: __global__ void, then attributes such as __launch_bounds__(...) or __maxnreg__(...)
_HEAD = re.compile(r"__global__\s+void\s+(?:__\w+__\s*\((?:[^()]|\([^()]*\))*\)\s*)*(\w+)\s*\(")
_INT32 = {"int", "unsigned", "u32", "int32_t", "uint32_t"}
_INT64 = {"i64", "u64", "long long", "size_t", "int64_t", "uint64_t"}
SMEM_OPTIN = 227 << 10  # bytes of dynamic shared memory a block may ask for on sm_90


@dataclass(frozen=True)
class Param:
    text: str  # as written, comments removed
    name: str
    kind: str  # "ptr", "i32", "i64", "f32", "f64"


def _strip_comments(src: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", src), flags=re.DOTALL)


def _split_top(text: str) -> list[str]:
    """text split at the commas outside any (), <> or []."""
    parts, depth, cur = [], 0, []
    for c in text:
        depth += (c in "(<[") - (c in ")>]")
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def param_of(text: str) -> Param:
    """One parameter declaration, e.g. `const float* __restrict__ x` -> Param(kind "ptr", name "x").
    Raises ValueError for a type it does not know the size of."""
    m = re.fullmatch(r"(.*?)(\w+)\s*(?:=\s*[^,]+)?", " ".join(text.split()), flags=re.DOTALL)
    if m is None:
        raise ValueError(f"cannot read the parameter {text!r}")
    ctype = " ".join(re.sub(r"\b(const|__restrict__|volatile)\b", " ", m.group(1)).split())
    if "*" in ctype:
        kind = "ptr"
    elif ctype in _INT32:
        kind = "i32"
    elif ctype in _INT64:
        kind = "i64"
    elif ctype == "float":
        kind = "f32"
    elif ctype == "double":
        kind = "f64"
    else:
        raise ValueError(f"parameter {text!r}: no known size for the type {ctype!r}")
    return Param(" ".join(text.split()), m.group(2), kind)


@cache
def kernels_in(source: str) -> dict[str, tuple[Param, ...]]:
    """{kernel name: its parameters} of every __global__ function defined in `source` (a .cu
    file's text). Raises ValueError where two kernels share a name with different parameters, or
    a parameter list holds a preprocessor line (its parameters would depend on the defines)."""
    src = _strip_comments(source)
    out: dict[str, tuple[Param, ...]] = {}
    for m in _HEAD.finditer(src):
        depth, j = 1, m.end()
        while depth:
            depth += (src[j] == "(") - (src[j] == ")")
            j += 1
        text = src[m.end() : j - 1]
        if "#" in text:
            raise ValueError(f"kernel {m.group(1)}: a preprocessor line inside its parameter list")
        params = tuple(param_of(p) for p in _split_top(text))
        if out.setdefault(m.group(1), params) != params:
            raise ValueError(f"two kernels named {m.group(1)} with different parameters")
    return out


# The numpy scalar types runtime/cuda/launch.py passes (its _C_SCALARS) -> the parameter kinds they fit.
_SCALAR_KINDS = {np.dtype(np.uint64): {"ptr", "i64"},  # launch.null_or's null pointer, or a 64-bit value
                 np.dtype(np.int32): {"i32"}, np.dtype(np.int64): {"i64"}, np.dtype(np.float32): {"f32"}}


def arg_kinds(arg, device_array: type) -> set[str]:
    """The parameter kinds a launch argument fits (launch.py's rules: device arrays pass their
    pointer, numpy scalars of its four types their value in their own C type); set() for anything
    else (a Python int or float has no C type: CuPy and the driver path would guess or refuse)."""
    if isinstance(arg, device_array):
        return {"ptr"}
    return set(_SCALAR_KINDS.get(arg.dtype, ())) if isinstance(arg, np.generic) else set()


def base_name(kernel_name: str) -> str:
    """`gemv_q8<type_q4_K, 16, false>` -> `gemv_q8`."""
    return kernel_name.split("<", 1)[0].strip()


def launch_problems(launch, device_array: type) -> list[str]:
    """What is wrong with one recorded launch (tests/cupy_stub.py Launch), as lines naming the
    kernel; [] when nothing is."""
    k = launch.kernel
    name = k.name
    kernels = kernels_in(k.module.code)
    params = kernels.get(base_name(name))
    if params is None:
        return [f"{name}: no __global__ kernel of that name in its module's source"]
    out = []
    if len(launch.args) != len(params):
        out.append(f"{name}: {len(launch.args)} arguments for {len(params)} parameters")
    else:
        for i, (arg, p) in enumerate(zip(launch.args, params)):
            fits = arg_kinds(arg, device_array)
            if p.kind not in fits:
                given = type(arg).__name__ if not fits else "/".join(sorted(fits))
                out.append(f"{name}: argument {i} `{p.text}` ({p.kind}) given {given}")
    threads = int(np.prod(launch.block))
    if not 1 <= threads <= 1024 or len(launch.block) > 3:
        out.append(f"{name}: block {launch.block}")
    grid = tuple(launch.grid) + (1, 1)
    if len(launch.grid) > 3 or min(grid[:3]) < 1 or grid[0] >= 1 << 31 or max(grid[1:3]) >= 1 << 16:
        out.append(f"{name}: grid {launch.grid}")
    if not 0 <= launch.shared_mem <= SMEM_OPTIN:
        out.append(f"{name}: {launch.shared_mem} bytes of shared memory")
    elif launch.shared_mem > launch.smem_limit:
        out.append(f"{name}: {launch.shared_mem} bytes of shared memory, {launch.smem_limit} allowed (launch.allow_shared)")
    if launch.cluster != 1 and (not 2 <= launch.cluster <= 8 or grid[0] % launch.cluster):
        out.append(f"{name}: clusters of {launch.cluster} on grid {launch.grid}")
    return out
