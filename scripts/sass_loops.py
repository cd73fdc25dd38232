"""The instruction mix of a kernel's main loop, from its SASS (no GPU): compiles the instances of
one kernels_cu file that match a pattern for sm_90, with the options NVRTC gets at run time
(runtime.cuda.compile.OPTIONS), disassembles them with cuobjdump, and prints for each the loop
with the longest body (the span between a backward branch and its target): its instruction count
and the count of each opcode. docs/PERF.md, session 26, used it to compare the Q4_K and Q6_K row
loops of gemv_q8 (instructions per chunk and per byte of weights).

Needs nvcc, cuobjdump, nvdisasm (cuobjdump -sass runs it) and c++filt on PATH (cuobjdump and
nvdisasm: the CUDA toolkit, or pip's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, whose binaries
are nvidia/cu13/bin/cuobjdump and nvidia/cu13/bin/nvdisasm in the wheels).

Usage (from the repository root, k4 importable):
    python scripts/sass_loops.py gemv.cu "gemv_q8<type_q4_K, true, 16, 2, true"
The pattern is a substring of the instance names the launchers use (quant_kernels.GROUPS,
kernel_names.KERNELS). --with IMMA picks the innermost loop holding that opcode (the int8
tensor-core products' item loop sits inside their step loop, whose x staging makes it widest):
    python scripts/sass_loops.py gemv_mma_staged.cu "staged_q4_K, true, 16, false>" --with IMMA
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+([^;]+);")
BRANCH = re.compile(r"\bBRA\b(?:\.\S+)?\s+(?:\S+,\s*)?0x([0-9a-f]+)")


def loop_mix(function_sass: str, opcode: str | None = None) -> tuple[int, int, collections.Counter] | None:
    """(start, end, opcode counts) of one loop in one function's SASS (cuobjdump -sass text): the
    backward branch whose span is widest, its target to the branch inclusive; with `opcode`, the
    narrowest span that holds that opcode (the innermost loop doing that work, e.g. IMMA: a tensor
    core product's loop inside its step loop). Opcodes without their predicate and modifiers
    (LDG.E.128 -> LDG). None if the function has no such loop."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in INSTRUCTION.finditer(function_sass)]
    ops_at = [(addr, re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]) for addr, text in ins]
    loops = [(int(b.group(1), 16), addr) for addr, text in ins if (b := BRANCH.search(text)) and int(b.group(1), 16) < addr]
    if opcode is not None:
        loops = [(s, e) for s, e in loops if any(s <= addr <= e and op == opcode for addr, op in ops_at)]
    if not loops:
        return None
    start, end = (min if opcode else max)(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter(op for addr, op in ops_at if start <= addr <= end)
    return start, end, ops


def functions(sass: str) -> dict[str, str]:
    """Mangled name -> its SASS text, for every function of a cuobjdump -sass listing."""
    parts = sass.split("Function : ")[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def _compile(src: str, names: list[str], out: Path) -> str:
    from k4.kernels_cu import SOURCE_DIR
    from k4.runtime.cuda.compile import OPTIONS

    wrapper = out / f"loops_{src}"
    refs = ",\n".join(f"    (void*)&{n}" for n in names)
    wrapper.write_text(f'#include "{src}"\nextern void* const k4_loop_instances[];\n'
                       f"void* const k4_loop_instances[] = {{\n{refs}\n}};\n")
    options = [o for o in OPTIONS if not o.startswith("-I")] + [f"-I{SOURCE_DIR}"]
    subprocess.run(["nvcc", "-arch=sm_90", *options, "-cubin", "-o", str(out / "k.cubin"), str(wrapper)], check=True)
    return subprocess.run(["cuobjdump", "-sass", str(out / "k.cubin")], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a kernels_cu file, e.g. gemv.cu")
    ap.add_argument("pattern", help="a substring of the instance names to compile")
    ap.add_argument("--with", dest="opcode", help="the innermost loop holding this opcode (e.g. IMMA) instead of the widest")
    a = ap.parse_args(argv)
    for tool in ("nvcc", "cuobjdump", "nvdisasm", "c++filt"):
        if shutil.which(tool) is None:
            print(f"error: {tool} is not on PATH (see this script's docstring)", file=sys.stderr)
            return 2
    from k4.runtime.cuda import kernel_names, quant_kernels

    group = quant_kernels.GROUPS.get(a.source)
    every = [n for g in group.values() for n in g] if group else list(kernel_names.KERNELS.get(a.source, ()))
    names = list(dict.fromkeys(n for n in every if a.pattern in n))
    if not names:
        print(f"error: no instance of {a.source} matches {a.pattern!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        sass = _compile(a.source, names, Path(tmp))
    fs = functions(sass)
    demangled = subprocess.run(["c++filt"], input="\n".join(fs), capture_output=True, text=True).stdout.split("\n")
    for text, name in zip(fs.values(), demangled):
        mix = loop_mix(text, a.opcode)
        if mix is None:
            print(f"{name}: no loop" + (f" holding {a.opcode}" if a.opcode else ""))
            continue
        start, end, ops = mix
        print(f"{name}\n  loop {start:#x}-{end:#x}: {sum(ops.values())} instructions; "
              + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
