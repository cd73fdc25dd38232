"""A corpus of small hostile GGUF files (issue 21), made from the bundled sample model, and the
run that tries each one under a memory and a time limit.

    python tests/hostile/make_corpus.py OUT_DIR                  # write the files and manifest.json
    python tests/hostile/make_corpus.py OUT_DIR --run [--mem-gb 2] [--json RESULT]

Categories: metadata (wrong types, ranges, relations to tensor shapes), parse (counts and
lengths that cost more than the file), tokenizer (vocabularies that disagree with the weights
or cost without limit), template (chat templates that loop, grow or recurse), text (markup and
control bytes in names). A case holds when k4 refuses it with one line of K4Error naming what
the case expects (or runs it, where it is valid), within CASE_SECONDS, never raising anything
else; `k4 info` on it exits 0 or 2 with no traceback and prints no ESC byte.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_bytes import KV, Model, TensorBytes, string  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

CASE_SECONDS = 10.0  # wall time of one case (templates stop at 2 s, parses of 16 MB files take ~1 s)
A = "llama."


@dataclass
class Case:
    """category, name; expect: "refused" (a K4Error whose message contains needle), "runs" or
    "either"; file: name in the corpus folder."""

    category: str
    name: str
    expect: str
    needle: str = ""
    file: str = ""


def _meta(name: str, key: str, vtype: V, v, needle: str | None = None, sub: V | None = None, expect: str = "refused"):
    def build() -> bytes:
        return Model.sample().set(key, vtype, v, sub).to_bytes()
    return Case("metadata", name, expect, key if needle is None else needle), build


def metadata_cases():
    bad_int = [("str", V.STRING, "five"), ("nan", V.FLOAT32, math.nan), ("array", V.ARRAY, [5], V.INT32),
               ("bool", V.BOOL, True), ("neg", V.INT32, -1), ("zero", V.UINT32, 0)]
    for key in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                "feed_forward_length", "context_length", "rope.dimension_count", "attention.key_length"):
        for label, vtype, v, *sub in bad_int:
            yield _meta(f"{key}={label}", A + key, vtype, v, sub=sub[0] if sub else None)
    yield _meta("block_count=2^32-1", A + "block_count", V.UINT32, 2**32 - 1)
    yield _meta("block_count=2^63", A + "block_count", V.UINT64, 2**63)
    yield _meta("block_count=4 (5 layers present)", A + "block_count", V.UINT32, 4)
    yield _meta("block_count=6 (5 layers present)", A + "block_count", V.UINT32, 6)
    yield _meta("embedding_length=255 (256 columns)", A + "embedding_length", V.UINT32, 255)
    yield _meta("head_count=16 (attn_q rows 256 = 32 x 8)", A + "attention.head_count", V.UINT32, 16)
    yield _meta("head_count=7", A + "attention.head_count", V.UINT32, 7)
    yield _meta("head_count=2^20", A + "attention.head_count", V.UINT32, 2**20)
    yield _meta("head_count_kv=3 (not a divisor)", A + "attention.head_count_kv", V.UINT32, 3)
    yield _meta("head_count_kv=64 (> head_count)", A + "attention.head_count_kv", V.UINT32, 64)
    yield _meta("feed_forward_length=255", A + "feed_forward_length", V.UINT32, 255)
    yield _meta("rope.dimension_count=7", A + "rope.dimension_count", V.UINT32, 7)
    yield _meta("rope.dimension_count=10000", A + "rope.dimension_count", V.UINT32, 10000)
    yield _meta("key_length=7", A + "attention.key_length", V.UINT32, 7)
    yield _meta("context_length=inf", A + "context_length", V.FLOAT32, math.inf)
    yield _meta("context_length=2^40", A + "context_length", V.UINT64, 2**40)
    for label, vtype, v in (("str", V.STRING, "1e-5"), ("nan", V.FLOAT32, math.nan), ("inf", V.FLOAT32, math.inf),
                            ("zero", V.FLOAT32, 0.0), ("neg", V.FLOAT32, -1e-5), ("one", V.FLOAT32, 1.0)):
        yield _meta(f"rms_epsilon={label}", A + "attention.layer_norm_rms_epsilon", vtype, v)
    for label, vtype, v in (("str", V.STRING, "10000"), ("nan", V.FLOAT32, math.nan), ("neg", V.FLOAT32, -1.0),
                            ("inf", V.FLOAT64, math.inf)):
        yield _meta(f"rope.freq_base={label}", A + "rope.freq_base", vtype, v)
    for tok in ("bos", "eos", "eot", "unknown"):
        key = f"tokenizer.ggml.{tok}_token_id"
        yield _meta(f"{tok}_token_id=str", key, V.STRING, "1")
        yield _meta(f"{tok}_token_id=nan", key, V.FLOAT32, math.nan)
        yield _meta(f"{tok}_token_id=array", key, V.ARRAY, [1, 2], sub=V.UINT32)
    yield _meta("bos_token_id=70000 (out of range: ignored, as llama.cpp does)", "tokenizer.ggml.bos_token_id", V.UINT32, 70000,
                expect="runs")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"):
        yield _meta(f"{key}=str", key, V.STRING, "true")
        yield _meta(f"{key}=u8", key, V.UINT8, 1)
    for key in ("general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.chat_template", "tokenizer.ggml.pre"):
        yield _meta(f"{key}=u32", key, V.UINT32, 7)
        yield _meta(f"{key}=array", key, V.ARRAY, ["a"], sub=V.STRING)
    yield _meta("general.name=not UTF-8", "general.name", V.STRING, b"\xff\xfe", needle="general.name")
    yield _meta("tokens=u32 array", "tokenizer.ggml.tokens", V.ARRAY, list(range(512)), sub=V.UINT32)
    yield _meta("tokens=string", "tokenizer.ggml.tokens", V.STRING, "a")
    yield _meta("scores=strings", "tokenizer.ggml.scores", V.ARRAY, ["0"] * 512, sub=V.STRING)
    yield _meta("scores=511", "tokenizer.ggml.scores", V.ARRAY, [0.0] * 511, sub=V.FLOAT32)
    yield _meta("token_type=strings", "tokenizer.ggml.token_type", V.ARRAY, ["1"] * 512, sub=V.STRING)
    yield _meta("token_type=f32", "tokenizer.ggml.token_type", V.ARRAY, [1.0] * 512, sub=V.FLOAT32)
    yield _meta("token_type=513", "tokenizer.ggml.token_type", V.ARRAY, [1] * 513, sub=V.INT32)
    yield _meta("merges=u32 array", "tokenizer.ggml.merges", V.ARRAY, [1, 2, 3], sub=V.UINT32)
    yield _meta("arch missing", "general.architecture", V.STRING, "", needle="architecture")


def _vocab(n: int) -> Callable[[], bytes]:
    def build() -> bytes:
        m = Model.sample()
        for key, pad in (("tokenizer.ggml.tokens", lambda i: f"<pad{i}>"), ("tokenizer.ggml.scores", lambda i: 0.0),
                         ("tokenizer.ggml.token_type", lambda i: 1)):
            kv = m.get(key)
            kv.value = list(kv.value[:n]) + [pad(i) for i in range(len(kv.value), n)]
        return m.to_bytes()
    return build


def _token(index: int, text: str, ttype: int | None = None) -> Callable[[], bytes]:
    def build() -> bytes:
        m = Model.sample()
        m.get("tokenizer.ggml.tokens").value[index] = text
        if ttype is not None:
            m.get("tokenizer.ggml.token_type").value[index] = ttype
        return m.to_bytes()
    return build


def _many_long_tokens() -> bytes:
    """Tokens 259.. replaced by 250 tokens of lengths 2..1000 made of one letter: many cut points."""
    m = Model.sample()
    tokens = m.get("tokenizer.ggml.tokens").value
    for i in range(259, 509):
        tokens[i] = "a" * (2 + (i - 259) * 4)
    return m.to_bytes()


def tokenizer_cases():
    yield Case("tokenizer", "511 tokens for 512 token_embd rows", "refused", "token_embd"), _vocab(511)
    yield Case("tokenizer", "513 tokens for 512 token_embd rows", "refused", "token_embd"), _vocab(513)
    yield Case("tokenizer", "BYTE token '<0xZZ>'", "refused", "BYTE"), _token(10, "<0xZZ>")
    yield Case("tokenizer", "BYTE token 'abc'", "refused", "BYTE"), _token(10, "abc")
    yield Case("tokenizer", "BYTE token ''", "refused", "BYTE"), _token(10, "")
    yield Case("tokenizer", "a 1 MB normal token", "refused", "characters long"), _token(300, "x" * 2**20)
    yield Case("tokenizer", "a 1,000-character normal token", "runs"), _token(300, "y" * 1000)
    yield Case("tokenizer", "250 tokens of 2..998 characters", "runs"), _many_long_tokens
    yield Case("tokenizer", "token text with ESC and markup", "runs"), _token(300, "\x1b[2J[/x][bold]")
    yield Case("tokenizer", "token with a lone surrogate", "refused", "tokenizer.ggml.tokens"), _token(300, "a\ud800b")


def _raw(head_tensors: int, head_kvs: int, body: bytes, pad_to: int = 0) -> bytes:
    data = struct.pack("<4sIQQ", b"GGUF", 3, head_tensors, head_kvs) + body
    return data + b"\0" * max(0, pad_to - len(data))


def _big_string_array(n: int, length: int = 0) -> Callable[[], bytes]:
    def build() -> bytes:
        item = string("x" * length)
        return _raw(0, 1, string("a") + struct.pack("<IIQ", V.ARRAY, V.STRING, n) + item * n)
    return build


def _tensor_infos(n: int) -> bytes:
    infos = b"".join(string(f"t{i}") + struct.pack("<IQIQ", 1, 32, 0, 0) for i in range(n))
    return _raw(n, 0, infos, pad_to=0) + b"\0" * 256


def parse_cases():
    yield Case("parse", "2M empty strings in one array (16 MB)", "either"), _big_string_array(2_000_000)
    yield Case("parse", "200k strings of 64 bytes (14 MB)", "either"), _big_string_array(200_000, 64)
    yield Case("parse", "array claims 2^62 strings", "refused", "damaged"), lambda: _raw(0, 1, string("a") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**62), 4096)
    yield Case("parse", "array claims 2^61 u64", "refused", "damaged"), lambda: _raw(0, 1, string("a") + struct.pack("<IIQ", V.ARRAY, V.UINT64, 2**61), 4096)
    yield Case("parse", "string length 2^63", "refused", "damaged"), lambda: _raw(0, 1, string("a") + struct.pack("<IQ", V.STRING, 2**63), 4096)
    yield Case("parse", "key length 2^64-1", "refused", "damaged"), lambda: _raw(0, 1, struct.pack("<Q", 2**64 - 1), 4096)
    yield Case("parse", "kv count 2^63", "refused", "damaged"), lambda: _raw(0, 2**63, b"", 4096)
    yield Case("parse", "tensor count 2^63", "refused", "damaged"), lambda: _raw(2**63, 0, b"", 4096)
    yield Case("parse", "1M tensor infos claimed in 1 MB", "refused", "damaged"), lambda: _raw(1_000_000, 0, b"", 2**20)
    yield Case("parse", "40,000 real tensor infos (over the 32,768 cap)", "refused", "damaged"), lambda: _tensor_infos(40_000)
    yield Case("parse", "3,000 real tensor infos", "either"), lambda: _tensor_infos(3_000)
    yield Case("parse", "array of arrays", "refused", "array of arrays"), lambda: _raw(0, 1, string("a") + struct.pack("<IIQ", V.ARRAY, V.ARRAY, 2) + struct.pack("<IQ", V.UINT8, 1) + b"\1" + struct.pack("<IQ", V.UINT8, 1) + b"\1", 64)
    yield Case("parse", "unknown value type 99", "refused", "damaged"), lambda: _raw(0, 1, string("a") + struct.pack("<I", 99), 64)
    yield Case("parse", "tensor with 2^31 dimensions", "refused", "damaged"), lambda: _raw(1, 0, string("t") + struct.pack("<I", 2**31), 4096)
    yield Case("parse", "4M-element u8 array (4 MB)", "either"), lambda: _raw(0, 1, string("a") + struct.pack("<IIQ", V.ARRAY, V.UINT8, 4_000_000) + b"\1" * 4_000_000)
    yield Case("parse", "a 1 MB key", "either"), lambda: _raw(0, 1, string("k" * 2**20) + struct.pack("<I", V.UINT8) + b"\1")
    yield Case("parse", "duplicate key", "refused", "damaged"), lambda: Model(Model.sample().kvs + [KV("general.name", V.STRING, "again")], Model.sample().tensors).to_bytes()


def _template(source: str) -> Callable[[], bytes]:
    return lambda: Model.sample().set("tokenizer.chat_template", V.STRING, source).to_bytes()


TEMPLATES = {
    "nested range(100000) loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "2 s"),
    "nested loops over a list": ("{% set x = range(100000)|list %}{% for i in x %}{% for j in x %}{{ '' }}{% endfor %}{% endfor %}", "2 s"),
    "3 GB string by doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(32) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "'~'"),
    "3 GB string by doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(32) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", "'+'"),
    "'x' * 3e9": ("{{ 'x' * 3000000000 }}", "'*'"),
    "list * 1e9": ("{{ ([1] * 1000000000)|length }}", "'*'"),
    "(9**1000000)|string": ("{{ (9**1000000)|string }}", "bits"),
    "' '|center(1e9)": ("{{ ' '|center(1000000000) }}", "over"),
    "'a'.ljust(1e9)": ("{{ 'a'.ljust(1000000000) }}", "over"),
    "'{:>1000000000}'.format(1)": ("{{ '{:>1000000000}'.format(1) }}", "format width"),
    "5,000 nested ifs": ("{% if true %}" * 5000 + "x" + "{% endif %}" * 5000, "compiled"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "chat template"),
    "2 MB of output": ("{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", "output"),
    "syntax error": ("{% for %}", "syntax error"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "no system role"),
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),
    "markup and ESC in the error": ("{{ raise_exception('[/x]\x1b[2J') }}", "[/x]"),
}


def template_cases():
    for name, (source, needle) in TEMPLATES.items():
        yield Case("template", name, "refused", needle), _template(source)


def _text(key: str, v: str) -> Callable[[], bytes]:
    return lambda: Model.sample().set(key, V.STRING, v).to_bytes()


def _tensor_name(name: str) -> bytes:
    m = Model.sample()
    m.tensors.append(TensorBytes(name, 0, [4], b"\0" * 16))
    return m.to_bytes()


def _key_name(name: str) -> bytes:
    return Model.sample().set(name, V.STRING, "[/x]\x1b]0;title\x07").to_bytes()


def text_cases():
    for label, v in (("markup", "[/x][bold red]x[/]"), ("ESC", "\x1b[2J\x1b]0;pwned\x07name"), ("newlines", "a\nb\rc")):
        yield Case("text", f"general.name with {label}", "runs"), _text("general.name", v)
    yield Case("text", "pre-tokenizer name with markup", "either"), _text("tokenizer.ggml.pre", "[/x]")
    yield Case("text", "architecture with markup and ESC", "refused", "not supported"), _text("general.architecture", "[/x]\x1b[31m")
    yield Case("text", "tensor named [/x] with ESC", "runs"), lambda: _tensor_name("[/x]\x1b[2J")
    yield Case("text", "key named [/x] with ESC", "runs"), lambda: _key_name("x.[/y]\x1b[5m")


CATEGORIES = (metadata_cases, parse_cases, tokenizer_cases, template_cases, text_cases)


def write_corpus(folder: Path) -> list[Case]:
    """Write every case's file to `folder` and a manifest.json; returns the cases."""
    folder.mkdir(parents=True, exist_ok=True)
    cases = []
    for make in CATEGORIES:
        for i, (case, build) in enumerate(make()):
            case.file = f"{case.category}-{i:03d}.gguf"
            (folder / case.file).write_bytes(build())
            cases.append(case)
    (folder / "manifest.json").write_text(json.dumps([asdict(c) for c in cases], indent=1), encoding="utf-8")
    return cases


def try_case(path: Path, category: str) -> tuple[str, str]:
    """What k4 makes of one file: ("refused", message) for a K4Error, ("runs", "") when it opens,
    tokenizes, renders its template and evaluates 3 tokens, ("broke", what) for anything else."""
    from k4.runtime.backend import make_backend
    from k4.runtime.chat_template import ChatTemplate
    from k4.runtime.errors import K4Error
    from k4.runtime.model import open_model
    from k4.runtime.tokenizer import Tokenizer

    try:
        mf = open_model(path)
        tok = Tokenizer.from_model(mf)
        ChatTemplate.from_model(mf, tok).render([{"role": "user", "content": "Hi"}])
        ids = tok.encode("Once upon a time")[:3]
        make_backend(mf, "numpy", 16).eval(ids)
        return "runs", ""
    except K4Error as exc:
        return "refused", str(exc)
    except BaseException as exc:  # noqa: BLE001 (any other exception is what the corpus looks for)
        return "broke", f"{type(exc).__name__}: {str(exc)[:200]}"


def info_holds(path: Path) -> str:
    """'' when `k4 info` on the file exits 0 or 2 without an exception and prints no ESC byte
    or unbalanced markup; else what went wrong."""
    from typer.testing import CliRunner

    from k4.cli.app import app

    r = CliRunner().invoke(app, ["info", "-m", str(path)])
    if r.exit_code not in (0, 2) or (r.exception is not None and not isinstance(r.exception, SystemExit)):
        return f"info exit {r.exit_code}: {type(r.exception).__name__}: {r.exception}"
    if "\x1b" in r.output:
        return "info printed an ESC byte"
    if r.exit_code == 2 and len(r.stderr.strip().splitlines()) != 1:
        return f"info printed {len(r.stderr.strip().splitlines())} error lines"
    return ""


def run_corpus(folder: Path) -> list[dict]:
    """Try every case of folder/manifest.json; a result per case: the Case fields, outcome,
    message, seconds, held (bool) and why (when not held)."""
    results = []
    for c in json.loads((folder / "manifest.json").read_text(encoding="utf-8")):
        t0 = time.perf_counter()
        outcome, message = try_case(folder / c["file"], c["category"])
        seconds = time.perf_counter() - t0
        why = info_holds(folder / c["file"]) if outcome != "broke" else message
        if not why and seconds > CASE_SECONDS:
            why = f"took {seconds:.1f} s"
        if not why and "\n" in message:
            why = "the error has several lines"
        if not why and c["expect"] != "either" and outcome != c["expect"]:
            why = f"expected {c['expect']}, got {outcome}: {message[:200]}"
        if not why and c["expect"] == "refused" and c["needle"] not in message:
            why = f"the error does not name {c['needle']!r}: {message[:200]}"
        results.append({**c, "outcome": outcome, "message": message[:300], "seconds": round(seconds, 3), "held": not why, "why": why})
    return results


def counts(results: list[dict]) -> dict[str, tuple[int, int]]:
    """category -> (cases tried, cases held)."""
    out: dict[str, tuple[int, int]] = {}
    for r in results:
        tried, held = out.get(r["category"], (0, 0))
        out[r["category"]] = (tried + 1, held + r["held"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--run", action="store_true", help="try every case after writing them")
    ap.add_argument("--mem-gb", type=float, default=2.0, help="address-space limit of the run (RLIMIT_AS), GiB")
    ap.add_argument("--json", type=Path, help="write the per-case results here")
    args = ap.parse_args()
    write_corpus(args.folder)
    if not args.run:
        return
    import resource

    limit = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    results = run_corpus(args.folder)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    for category, (tried, held) in counts(results).items():
        print(f"{category:10s} {held:4d} / {tried:4d} held")
    for r in results:
        if not r["held"]:
            print(f"NOT HELD {r['category']} {r['name']}: {r['why']}")


if __name__ == "__main__":
    main()
