"""A prototype, measured against main's kernels (GPU): the last rounds of a one-token product's
rows taken by its warps as they finish instead of round robin. Session 46's stamps (block_stamps.py)
found a product's blocks ending 0.4-1.2 µs apart on average with its rows spread evenly, so the
spread is the memory's, not the work's; warps that claim the tail's rows from a counter as they
get there would end closer together (docs/PERF.md, session 48).

The prototype is an edit of a copy of kernels_cu (take_away.py's apply_cut and use_sources: the
repository is never touched): gemv_common.cuh's row loop takes its next output from a policy
(q8_rows_by; q8_rows: round robin), and gemv.cu's gemv_q8, for the instances whose rows go
round robin (not the NQ, SwiGLU-handoff or output head's argmax ones), runs it with RowClaims,
which keeps the static rows of all rounds but the last one or two (TAIL_ROUNDS) and hands out
the tail's rows
from CLAIM_GROUPS counters (block b claims from counter b % CLAIM_GROUPS, which serves every
CLAIM_GROUPS-th tail row), one claim issued a row ahead of its use so its L2 round trip overlaps a
row. The counters are module globals that each launch's last warp of a group sets back to zero;
claims start after the programmatic-dependent-launch wait, so consecutive products never claim
at once. Each row is still one warp's whole row: the outputs keep their bits.

Usage (from the repository root, k4 importable, on the GPU machine):
    python scripts/row_claims.py [TYPE:N_OUTxN_IN[:q8] ...]        bench_gemv, main against claims
    python scripts/row_claims.py -m MODEL.gguf [-n 128] [-r 3]      decode logits (the same bits?), then tgN
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from block_stamps import parse_shape  # scripts/block_stamps.py
from take_away import apply_cut, bench_ts, use_sources  # scripts/take_away.py

CLAIM_GROUPS = 8  # counters a launch's blocks claim from (block b: counter b % CLAIM_GROUPS)
TAIL_ROUNDS = 1  # the rows past the last full round and this many rounds before it are claimed

# gemv_common.cuh: q8_rows's loop as q8_rows_by, the next output from a policy (q8_rows: round robin)
_LOOP_HEAD = ("template <class T, int U, bool PF, bool GLU, class Load, class Out>\n"
              "__device__ __forceinline__ void q8_rows(int n_chunks, int row, int row_end, int row_step, int lane, "
              "typename T::chunk (&ch)[U],\n                                        bool loaded, const q8x<T::x_swizzle>& xv, "
              "Load load, Out out) {\n")
_BY_HEAD = ("template <class T, int U, bool PF, bool GLU, class Next, class Load, class Out>\n"
            "__device__ __forceinline__ void q8_rows_by(int n_chunks, int row, int row_end, Next& next, int lane, "
            "typename T::chunk (&ch)[U],\n                                           bool loaded, const q8x<T::x_swizzle>& xv, "
            "Load load, Out out) {\n")
_STEP = """struct RowStep {  // q8_rows_by's round robin
    int step;
    __device__ __forceinline__ int operator()(int row) const { return row + step; }
};
template <class T, int U, bool PF, bool GLU, class Load, class Out>
__device__ __forceinline__ void q8_rows(int n_chunks, int row, int row_end, int row_step, int lane, typename T::chunk (&ch)[U],
                                        bool loaded, const q8x<T::x_swizzle>& xv, Load load, Out out) {
    RowStep next{row_step};
    q8_rows_by<T, U, PF, GLU>(n_chunks, row, row_end, next, lane, ch, loaded, xv, load, out);
}

"""

# gemv.cu: the claims policy, and gemv_q8's rows through it where they go round robin
_CLAIMS = """
// ---- scripts/row_claims.py's prototype: the tail of a round-robin product's rows, claimed -------
constexpr int K4_CLAIM_GROUPS = {groups}, K4_TAIL_ROUNDS = {tail};
__device__ unsigned long long k4_claims[2 * K4_CLAIM_GROUPS];  // per group: claims made, warps done

// A warp's outputs: its round-robin ones (row, + W, ...) below tail0, then the tail's, claimed
// from its group's counter one output ahead (the claim's L2 round trip overlaps an output).
struct RowClaims {{
    unsigned long long* ctr;
    unsigned long long pending;  // lane 0: the claim in flight
    unsigned long long warps_g;  // the group's warps
    int W, n_out, tail0, ng, g, n_g, lane;
    bool claiming;
    __device__ RowClaims(int row_step, int row_end, int lane_) : pending(0), W(row_step), n_out(row_end), lane(lane_), claiming(false) {{
        tail0 = max(0, n_out / W - K4_TAIL_ROUNDS) * W;
        const int n_tail = n_out - tail0;
        ng = min(K4_CLAIM_GROUPS, (int)gridDim.x);
        g = blockIdx.x % ng;
        n_g = n_tail > g ? (n_tail - 1 - g) / ng + 1 : 0;  // the group's tail outputs: tail0 + g + ng i, i < n_g
        warps_g = (unsigned long long)((gridDim.x - 1 - g) / ng + 1) * (blockDim.x >> 5);
        ctr = k4_claims + 2 * g;
    }}
    __device__ void issue() {{
        if (lane == 0) pending = atomicAdd(ctr, 1ull);
    }}
    __device__ int take() {{  // the claimed output, or n_out: none left
        const unsigned long long i = __shfl_sync(0xffffffffu, pending, 0);
        return i < (unsigned long long)n_g ? tail0 + g + ng * (int)i : n_out;
    }}
    __device__ int claim() {{
        claiming = true;
        const int r = take();
        if (r < n_out) issue();
        return r;
    }}
    __device__ int first(int row) {{  // the warp's first output (row: its round-robin one)
        if (row >= tail0) {{
            issue();
            return claim();
        }}
        if (row + W >= tail0) issue();
        return row;
    }}
    __device__ int operator()(int row) {{
        if (claiming || row + W >= tail0) return claim();
        if (row + 2 * W >= tail0) issue();  // the output after the next one is claimed: ask now
        return row + W;
    }}
    __device__ void finish() {{  // the group's last warp sets its counters back for the next launch
        if (lane == 0 && atomicAdd(ctr + 1, 1ull) == warps_g - 1) {{
            ctr[0] = 0;
            ctr[1] = 0;
        }}
    }}
}};

template <class T, int U, bool PF, bool GLU, bool CLAIMS, class Load, class Out>
__device__ __forceinline__ void q8_rows_or_claims(bool grouped, int n_chunks, int row, int row_end, int row_step, int lane,
                                                  typename T::chunk (&ch)[U], const q8x<T::x_swizzle>& xv, Load load, Out out) {{
    if (!CLAIMS || grouped) {{
        q8_rows<T, U, PF, GLU>(n_chunks, row, row_end, row_step, lane, ch, true, xv, load, out);
        return;
    }}
    RowClaims rows(row_step, row_end, lane);
    const int first = rows.first(row);  // ch holds output row's first chunks (loaded before the wait)
    q8_rows_by<T, U, PF, GLU>(n_chunks, first, row_end, rows, lane, ch, first == row, xv, load, out);
    rows.finish();
}}

"""

_CALL = "    q8_rows<T, U, PF, GLU>(n_chunks, row, row_end, row_step, lane, ch, true, xv, load, [&](int r, float acc, float acc_up) {"
_CALL_END = "    });\n    if (AM && lane == 0) {  // no barrier"

# (kernels_cu file, anchor, replacement)
EDITS: list[tuple[str, str, str]] = [
    ("gemv_common.cuh", _LOOP_HEAD, _BY_HEAD),
    ("gemv_common.cuh", "            next_row += row_step;\n", "            next_row = next(row);\n"),
    ("gemv_common.cuh", "__host__ __device__ constexpr bool q8x_layout_agrees()", _STEP + "__host__ __device__ constexpr bool q8x_layout_agrees()"),
    ("gemv.cu", '#include "mma_common.cuh"  // k4mma::cp_async16 (NQ\'s norm weights)\n',
     '#include "mma_common.cuh"  // k4mma::cp_async16 (NQ\'s norm weights)\n' + _CLAIMS.format(groups=CLAIM_GROUPS, tail=TAIL_ROUNDS)),
    ("gemv.cu", _CALL, "    auto out_row = [&](int r, float acc, float acc_up) {"),
    ("gemv.cu", _CALL_END,
     "    };\n    q8_rows_or_claims<T, U, PF, GLU, !NQ && !AM>(HANDOFF && y_q8, n_chunks, row, row_end, row_step, lane, ch, xv, load,\n"
     "                                                 out_row);\n    if (AM && lane == 0) {  // no barrier"),
]
DEFAULT_SHAPES = ("Q4_K:37888x3584", "Q4_K:22016x4096", "Q6_K:32000x4096", "Q4_K:11264x2048", "Q4_K:4608x3584")


def decode_logits(model: str, n_ctx: int = 256) -> list:
    """The logits of three decode steps after a 9-token prompt of `model` on a fresh CudaBackend
    (the sources in use compile it): every product of a decode step, the SwiGLU ones included."""
    import numpy as np

    from k4.runtime.cuda.backend import CudaBackend
    from k4.runtime.model import open_model

    mf = open_model(model)
    be = CudaBackend(mf, n_ctx)
    try:
        be.eval(list(range(3, 12)))
        return [np.asarray(be.eval([t])) for t in (7, 8, 9)]
    finally:
        be.close()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", help="TYPE:N_OUTxN_IN[:q8] products for bench_gemv (default: the big ones)")
    ap.add_argument("-m", "--model", help="time tgN of this model instead")
    ap.add_argument("-n", type=int, default=128, help="tokens a tgN run generates (default 128)")
    ap.add_argument("-r", type=int, default=3, help="repetitions a run (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="main / claims pairs, alternated (default 2)")
    a = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in (a.shapes or DEFAULT_SHAPES)]

    from k4.kernels_cu import SOURCE_DIR
    from k4.runtime.cuda import microbench as mb
    from k4.runtime.flags import Flags

    with tempfile.TemporaryDirectory(prefix="k4-claims-") as tmp:
        apply_cut(SOURCE_DIR, Path(tmp), EDITS)
        sources = {"main": Path(SOURCE_DIR), "claims": Path(tmp)}
        try:
            if a.model:  # the claimed rows are whole rows: the same bits
                logits = {}
                for name, src in sources.items():
                    use_sources(src)
                    logits[name] = decode_logits(a.model)
                same = all((x == y).all() for x, y in zip(logits["main"], logits["claims"]))
                print(f"decode logits with claims: {'the same bits' if same else 'DIFFERENT from main'}", flush=True)
            for _ in range(a.rounds):
                for name, src in sources.items():
                    use_sources(src)
                    if a.model:
                        args = ["-m", a.model, "--backend", "cuda", "-p", "0", "-n", str(a.n), "-r", str(a.r)]
                        print(f"{name:7s} tg{a.n} {bench_ts(args):10.2f} t/s", flush=True)
                        continue
                    for ty, n_out, n_in, q8 in shapes:
                        us = mb.bench_gemv(ty, n_out, n_in, iters=100, x_q8=q8, flags=Flags({}))["us"]
                        print(f"{name:7s} {ty} {n_out}x{n_in}{' x q8' if q8 else ''}: {us:8.2f} µs", flush=True)
        finally:
            use_sources(Path(SOURCE_DIR))


if __name__ == "__main__":
    main(sys.argv[1:])
