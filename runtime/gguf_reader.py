"""gguf's GGUFReader with a parse whose cost is bounded by the file size.

Format: GGUF v2/v3 (ggml docs/gguf.md): header (magic, version, tensor count, key/value
count), key/value pairs, tensor infos, aligned tensor data; little-endian only.

The gguf package's reader makes two numpy arrays per element of every metadata array (about
1.5 KB of memory for an empty string that takes 8 bytes on disk: a 97 MB array of empty strings
took 7.3 GB and 71 s) and six per tensor info (about 5 KB each). `BoundedReader` keeps the
package's tensor handling but reads the key/value section itself: every length and count is
checked against the bytes left before anything is made of it, numeric arrays are one view of the
map, and string arrays keep one 8-byte offset per element; elements become arrays only when
indexed. Tensor counts are limited to what the file can hold (MAX_TENSORS at most), so the
parse holds at most about 64 MiB + 16 x the file size.

Fields are `MetaField`s, gguf's ReaderField with the same `name`, `types`, `data`, `parts` and
`contents()`, so code written for GGUFReader reads them unchanged.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

# Tensor infos GGUFReader will be asked to build (~5 KB of memory each): 16x llama.cpp's largest
# models (DeepSeek-V3: ~1,900 tensors); a file claiming more is refused before the parse.
MAX_TENSORS = 32768
# Bytes of a tensor info at least: name length (8), n_dims (4), one dimension (8), type (4), offset (8).
MIN_TENSOR_INFO = 32
_SCALARS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


class GGUFDamage(ValueError):
    """A count, length or type in the file that it cannot hold; the message says which and where."""


class _StringParts:
    """The `parts` of a string array field, built on demand: [key length, key, type, element
    type, count] then, per element, its length and its bytes."""

    def __init__(self, head: list[np.ndarray], data: np.ndarray, offsets: np.ndarray):
        self.head, self.buf, self.offsets = head, data, offsets  # offsets: (count,) uint64

    def __len__(self) -> int:
        return len(self.head) + 2 * len(self.offsets)

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if i < len(self.head):
            return self.head[i]
        j = i - len(self.head)
        off = int(self.offsets[j // 2])
        length = self.buf[off:off + 8].view("<u8")
        return length if j % 2 == 0 else self.buf[off + 8:off + 8 + int(length[0])]

    def strings(self, which: slice) -> list[str]:
        """The elements `which` selects, decoded as UTF-8 (UnicodeDecodeError otherwise)."""
        mv, out = memoryview(self.buf), []
        for off in self.offsets[which].tolist():
            (n,) = struct.unpack_from("<Q", mv, off)
            out.append(str(mv[off + 8:off + 8 + n], encoding="utf-8"))
        return out


class MetaField(ReaderField):
    """A key/value field (gguf ReaderField) whose array elements are read when asked for."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value: a scalar, a str, or a list (for arrays; one element for an int index).
        Raises UnicodeDecodeError for a string that is not UTF-8."""
        if isinstance(self.parts, _NumericParts):
            return self.parts.values[index_or_slice].tolist()
        if isinstance(self.parts, _StringParts):
            if isinstance(index_or_slice, int):
                return str(self.parts[self.data[index_or_slice]].tobytes(), encoding="utf-8")
            return self.parts.strings(index_or_slice)
        return super().contents(index_or_slice)


class BoundedReader(GGUFReader):
    """GGUFReader (gguf package) on a plain ndarray view of its memory map, with the key/value
    section read as described in the module docstring. Raises GGUFDamage (or the errors the
    package raises on a damaged tensor table) for a file it cannot read."""

    def _get(self, offset, dtype, count=1, override_order=None):
        # np.memmap slices pay memmap's bookkeeping: 0.8 s instead of 0.3 s for a 32,000-token vocabulary
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs: int, count: int) -> int:
        size = len(self.data)
        if int(count) > (size - offs) // 13:  # a key takes 8 + 1 + 4 bytes at least
            raise GGUFDamage(f"{int(count)} keys cannot fit in {size} bytes")
        for _ in range(int(count)):
            offs = self._read_field(offs, size)
        return offs

    def _need(self, offs: int, n: int, size: int) -> None:
        if n < 0 or offs + n > size:
            raise GGUFDamage(f"a field at byte {offs} runs past the end of the file")

    def _string(self, offs: int, size: int) -> tuple[np.ndarray, np.ndarray, int]:
        self._need(offs, 8, size)
        length = self.data[offs:offs + 8].view("<u8")
        n = int(length[0])
        self._need(offs + 8, n, size)
        return length, self.data[offs + 8:offs + 8 + n], offs + 8 + n

    def _read_field(self, start: int, size: int) -> int:
        klen, kdata, offs = self._string(start, size)
        self._need(offs, 4, size)
        vtype_arr = self.data[offs:offs + 4].view("<u4")
        offs += 4
        head = [klen, kdata, vtype_arr]
        vtype = self._value_type(int(vtype_arr[0]), offs)
        if vtype == GGUFValueType.STRING:
            slen, sdata, end = self._string(offs, size)
            parts, data, types = head + [slen, sdata], [4], [vtype]
        elif vtype in _SCALARS:
            width = np.dtype(_SCALARS[vtype]).itemsize
            self._need(offs, width, size)
            end = offs + width
            parts, data, types = head + [self.data[offs:end].view(_SCALARS[vtype])], [3], [vtype]
        else:
            parts, data, types, end = self._array(head, offs, size)
        self._push_field(MetaField(start, str(bytes(kdata), encoding="utf-8"), parts, data, types), skip_sum=True)
        return end

    def _value_type(self, raw: int, offs: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFDamage(f"unknown value type {raw} at byte {offs}") from None

    def _array(self, head: list[np.ndarray], offs: int, size: int):
        self._need(offs, 12, size)
        itype_arr = self.data[offs:offs + 4].view("<u4")
        count_arr = self.data[offs + 4:offs + 12].view("<u8")
        itype, count = self._value_type(int(itype_arr[0]), offs), int(count_arr[0])
        offs += 12
        head = head + [itype_arr, count_arr]
        if itype in _SCALARS:
            width = np.dtype(_SCALARS[itype]).itemsize
            self._need(offs, count * width, size)
            values = self.data[offs:offs + count * width].view(_SCALARS[itype])  # (count,) a view of the map
            parts, head_len = _NumericParts(head, values), len(head)
            return parts, range(head_len, head_len + count), [GGUFValueType.ARRAY, itype], offs + count * width
        if itype != GGUFValueType.STRING:
            raise GGUFDamage(f"an array of arrays at byte {offs - 12}; GGUF readers (llama.cpp's gguf.cpp) accept arrays of numbers or strings only")
        self._need(offs, count * 8, size)  # every string takes 8 bytes at least
        offsets = np.empty(count, dtype=np.uint64)  # (count,) byte offset of each element's length
        for i in range(count):
            offsets[i] = offs
            (n,) = struct.unpack_from("<Q", self.data, offs)
            offs += 8
            self._need(offs, n, size)
            offs += n
        parts = _StringParts(head, self.data, offsets)
        first = len(head) + 1
        return parts, range(first, first + 2 * count, 2), [GGUFValueType.ARRAY, itype], offs

    def _build_tensor_info(self, offs: int, count: int):
        size = len(self.data)
        if int(count) > min(MAX_TENSORS, (size - offs) // MIN_TENSOR_INFO):
            raise GGUFDamage(f"{int(count)} tensors cannot fit in {size} bytes (k4 reads at most {MAX_TENSORS})")
        return super()._build_tensor_info(offs, count)


class _NumericParts:
    """The `parts` of a numeric array field: the header parts, then one element per index."""

    def __init__(self, head: list[np.ndarray], values: np.ndarray):
        self.head = head + [values]
        self.n_head = len(head)
        self.values = values  # (count,) a view of the map

    def __len__(self) -> int:
        return self.n_head + len(self.values)

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        return self.head[i] if i < self.n_head else self.values[i - self.n_head:i - self.n_head + 1]
