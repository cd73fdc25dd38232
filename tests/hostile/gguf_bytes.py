"""GGUF files byte by byte, for hostile test inputs: any value type under any key, counts and
lengths that lie, tensors of any name and shape. Format: ggml docs/gguf.md (v3, little-endian).

`Model.read(path)` (`Model.sample()`: the bundled sample model) reads a GGUF into an editable
list of key/values and tensors; `Model.to_bytes()` writes it back (32-byte alignment).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader, GGUFValueType as V

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "stories260k-q4_k_m.gguf"
ALIGN = 32
_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
        V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def string(s: str | bytes) -> bytes:
    b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: V, v, sub: V | None = None) -> bytes:
    """The encoding of one value of type vtype (sub: element type of an array)."""
    if vtype == V.STRING:
        return string(v)
    if vtype == V.ARRAY:
        return struct.pack("<IQ", sub, len(v)) + b"".join(value(sub, x) for x in v)
    return struct.pack(_FMT[vtype], v)


@dataclass
class KV:
    key: str
    vtype: V
    value: object
    sub: V | None = None

    def to_bytes(self) -> bytes:
        return string(self.key) + struct.pack("<I", self.vtype) + value(self.vtype, self.value, self.sub)


@dataclass
class TensorBytes:
    name: str
    ggml_type: int
    ne: list[int]  # ggml order: ne[0] is the row length
    data: bytes


@dataclass
class Model:
    kvs: list[KV] = field(default_factory=list)
    tensors: list[TensorBytes] = field(default_factory=list)

    @classmethod
    def sample(cls) -> "Model":
        return cls.read(SAMPLE)

    @classmethod
    def read(cls, path: Path) -> "Model":
        r = GGUFReader(path)
        kvs = []
        for key, f in r.fields.items():
            if key.startswith("GGUF."):
                continue
            sub = f.types[-1] if f.types[0] == V.ARRAY else None
            kvs.append(KV(key, f.types[0], f.contents(), sub))
        tensors = [TensorBytes(t.name, int(t.tensor_type), [int(d) for d in t.shape], bytes(t.data.reshape(-1).view("u1")))
                   for t in r.tensors]
        return cls(kvs, tensors)

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, vtype: V, v, sub: V | None = None) -> "Model":
        """Replace (in place) or add the key."""
        kv = self.get(key)
        if kv is None:
            self.kvs.append(KV(key, vtype, v, sub))
        else:
            kv.vtype, kv.value, kv.sub = vtype, v, sub
        return self

    def drop(self, key: str) -> "Model":
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        return self

    def to_bytes(self, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
        """The file; n_tensors / n_kv override the counts in the header (to lie)."""
        head = struct.pack("<4sIQQ", b"GGUF", 3, len(self.tensors) if n_tensors is None else n_tensors,
                           len(self.kvs) if n_kv is None else n_kv)
        body = b"".join(kv.to_bytes() for kv in self.kvs)
        infos, offset = [], 0
        for t in self.tensors:
            infos.append(string(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
                         + struct.pack("<IQ", t.ggml_type, offset))
            offset += -(-len(t.data) // ALIGN) * ALIGN
        out = bytearray(head + body + b"".join(infos))
        out += b"\0" * (-len(out) % ALIGN)
        for t in self.tensors:
            out += t.data + b"\0" * (-len(t.data) % ALIGN)
        return bytes(out)
