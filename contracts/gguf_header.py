"""A GGUF's metadata and tensor list, read in milliseconds: what every process checks at start, without gguf-py's
GGUFReader, which builds numpy views of every array element (the tokenizer's 49k tokens and 49k merges): 1-2 s a
read of the embedded 135M model on the development machine, and a start read the same file up to seven times over
its processes (docs/decode.md, "Start-up time").

`read_header(path)` answers the same questions as a GGUFReader for the parts the start-up checks use:
`get_field(key).contents()` (the same Python values: a str, an int, a float, a bool, or a list of them) and
`tensors` (each with `name`, `tensor_type`, `shape` in ggml's order, `n_elements`); no tensor data. A string array
is decoded only when asked for. Kept per (path, size, mtime) in the process.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # as gguf-py reads
_STRING, _ARRAY = 8, 9
# GGUFValueType -> struct format of one value
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class HeaderField:
    name: str
    value: object  # a scalar, a str, a list, or _Strings (an array of strings, decoded when asked)

    def contents(self):
        return self.value.decode() if isinstance(self.value, _Strings) else self.value


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: [inputs, outputs] for a matrix
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the data section

@dataclass(frozen=True)
class GGUFHeader:
    path: str
    fields: dict[str, HeaderField]
    tensors: tuple[HeaderTensor, ...]

    def get_field(self, key: str) -> HeaderField | None:
        return self.fields.get(key)


@dataclass(frozen=True)
class _Strings:
    """An array of strings, left in the file until asked for: (offset of the first, count)."""
    path: str
    order: str
    offset: int
    count: int

    def decode(self) -> list[str]:
        with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, self.order, self.offset)
            return [cursor.string() for _ in range(self.count)]


def read_header(path: str) -> GGUFHeader:
    stat = os.stat(path)
    return _read(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic invalid)")
        # a file written on a machine of the other byte order reads as a version with its low 16 bits zero
        order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"
        cursor = _Cursor(data, order, 4)
        version = cursor.scalar(4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        num_tensors, num_fields = cursor.scalar(10), cursor.scalar(10)
        try:
            fields = _fields(cursor, num_fields, path)
            tensors = tuple(cursor.tensor() for _ in range(num_tensors))
        except (struct.error, UnicodeDecodeError) as err:  # a read past the end, or garbage where a name should be
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({err})") from None
        _check_size(path, fields, tensors, cursor.offset, size)
    return GGUFHeader(path, fields, tensors)


def _fields(cursor: _Cursor, count: int, path: str) -> dict[str, HeaderField]:
    fields: dict[str, HeaderField] = {}
    for _ in range(count):
        name = cursor.string()
        if name in fields:
            raise ValueError(f"{path}: duplicate GGUF metadata key {name!r}")
        fields[name] = HeaderField(name, cursor.value(cursor.scalar(4), path))
    return fields


def _check_size(path: str, fields: dict[str, HeaderField], tensors: tuple[HeaderTensor, ...], end: int,
                size: int) -> None:
    """A truncated file is refused here, as gguf-py refuses it (its views of the tensor data would not fit)."""
    alignment = fields["general.alignment"].value if "general.alignment" in fields else GGUF_DEFAULT_ALIGNMENT
    data_start = -(-end // alignment) * alignment
    needed = max((data_start + t.data_offset + t.n_bytes for t in tensors), default=end)
    if needed > size:
        raise ValueError(f"{path}: truncated: its tensors need {needed} bytes, the file has {size}")


class _Cursor:
    def __init__(self, data, order: str, offset: int) -> None:
        self.data, self.order, self.offset = data, order, offset

    def scalar(self, kind: int):
        fmt = self.order + _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar(10)
        start, self.offset = self.offset, self.offset + length
        return bytes(self.data[start:self.offset]).decode("utf-8")

    def value(self, kind: int, path: str):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind != _ARRAY:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        item, count = self.scalar(4), self.scalar(10)
        if item == _STRING:  # skipped now (the tokenizer's tens of thousands), decoded when asked for
            strings = _Strings(path, self.order, self.offset, count)
            length = struct.Struct(self.order + "Q").unpack_from
            data, offset = self.data, self.offset
            for _ in range(count):
                offset += 8 + length(data, offset)[0]
            self.offset = offset
            return strings
        if item in _SCALARS:
            fmt = f"{self.order}{count}{_SCALARS[item]}"
            values = list(struct.unpack_from(fmt, self.data, self.offset))
            self.offset += struct.calcsize(fmt)
            return values
        flat = []  # an array of arrays: flattened, as gguf-py's contents() gives it
        for _ in range(count):
            inner = self.value(item, path)
            flat.extend(inner.decode() if isinstance(inner, _Strings) else inner)
        return flat

    def tensor(self) -> HeaderTensor:
        name = self.string()
        shape = tuple(self.scalar(10) for _ in range(self.scalar(4)))
        tensor_type = GGMLQuantizationType(self.scalar(4))
        n_elements = 1
        for n in shape:
            n_elements *= n
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        return HeaderTensor(name, tensor_type, shape, n_elements, n_elements * type_size // block_size,
                            self.scalar(10))
