"""A GGUF's metadata and tensor list, read in milliseconds: what every process checks at start, without gguf-py's
GGUFReader, which builds numpy views of every array element (the tokenizer's 49k tokens and 49k merges): 1-2 s a
read of the embedded 135M model on the development machine, and a start read the same file up to seven times over
its processes (docs/decode.md, "Start-up time").

`read_header(path)` answers the same questions as a GGUFReader for the parts the start-up checks use:
`get_field(key).contents()` (the same Python values: a str, an int, a float, a bool, or a list of them) and
`tensors` (each with `name`, `tensor_type`, `shape` in ggml's order, `n_elements`); no tensor data. An array is
decoded only when asked for. Kept per (path, size, mtime) in the process.

The file may be hostile (docs/security.md, "Model files"): every count and length is checked against a bound and
against the bytes left in the file before anything is read or allocated by it, so the read takes milliseconds and
memory in proportion to the number of keys and tensors, whatever the header claims; the tensors must lie in the
file one after another as llama.cpp requires. Anything else is a GGUFError naming what is wrong, its value and
the bound. contracts.gguf_check then holds the model's own numbers to bounds and to the tensors present.
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
# Bounds far above any real model's (the largest: ~1.1k tensors, ~50 keys, a 262k-token vocabulary, chat templates
# of tens of KiB) and far below what would take a reader long or much memory.
MAX_TENSORS = 1 << 16
MAX_FIELDS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 21  # a string array is walked item by item: 2M items take about a second
MAX_STRING_BYTES = 1 << 24
MAX_TENSOR_NAME_BYTES = 63  # llama.cpp's GGML_MAX_NAME, less its terminating zero
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
# ggml's integer types hold indices, never a model's weights: a weight in one has ggml abort at the first op
INTEGER_TYPES = frozenset({GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                           GGMLQuantizationType.I64})
# the fewest bytes one key/value and one tensor description can take: a bound on the counts from the file's size
_MIN_FIELD_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a one-byte name, dims count, one dim, type, offset


class GGUFError(ValueError):
    """A GGUF that is corrupt or hostile: `reason` names what is wrong, its value and the bound."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class HeaderField:
    name: str
    value: object  # a scalar, a str, or an array left in the file (_Array), decoded when asked

    def contents(self):
        return self.value.decode() if isinstance(self.value, _Array) else self.value

    @property
    def num_items(self) -> int | None:
        """An array's length, without decoding it; None for a scalar or a string."""
        return self.value.count if isinstance(self.value, _Array) else None


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
    data_start: int = 0  # where the data section begins in the file (a tensor's bytes: data_start + data_offset)

    def get_field(self, key: str) -> HeaderField | None:
        return self.fields.get(key)


@dataclass(frozen=True)
class _Array:
    """An array left in the file until asked for (the tokenizer's tens of thousands of items): where its first
    item is, its item type and its length, all checked at read."""
    path: str
    order: str
    item: int  # GGUFValueType of every item
    offset: int
    count: int

    def decode(self) -> list:
        with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, self.order, self.offset, self.path)
            if self.item == _STRING:
                return [cursor.string("an array item") for _ in range(self.count)]
            return list(struct.unpack_from(f"{self.order}{self.count}{_SCALARS[self.item]}", data, self.offset))


def read_header(path: str) -> GGUFHeader:
    stat = os.stat(path)
    return _read(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else _Empty() as data:
        if data[:4] != GGUF_MAGIC:
            raise GGUFError(path, "not a GGUF file (magic invalid)")
        try:
            # a file written on a machine of the other byte order reads as a version with its low 16 bits zero
            order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"
            cursor = _Cursor(data, order, 4, path)
            version = cursor.scalar(4)
            if version not in SUPPORTED_VERSIONS:
                raise GGUFError(path, f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
            num_tensors = cursor.count("the tensor count", MAX_TENSORS, _MIN_TENSOR_BYTES)
            num_fields = cursor.count("the metadata key count", MAX_FIELDS, _MIN_FIELD_BYTES)
            fields = _fields(cursor, num_fields)
            tensors = tuple(cursor.tensor() for _ in range(num_tensors))
        except struct.error as err:  # a read past the end
            raise GGUFError(path, f"truncated or corrupt GGUF header ({err})") from None
        _check_layout(path, fields, tensors, cursor.offset, size)
    alignment = _alignment(path, fields)
    return GGUFHeader(path, fields, tensors, -(-cursor.offset // alignment) * alignment)


class _Empty(bytes):
    """mmap refuses an empty file: an empty buffer reads as what it is, a file without the magic."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _fields(cursor: _Cursor, count: int) -> dict[str, HeaderField]:
    fields: dict[str, HeaderField] = {}
    for _ in range(count):
        name = cursor.string("a metadata key")
        if name in fields:
            raise GGUFError(cursor.path, f"duplicate GGUF metadata key {name!r}")
        fields[name] = HeaderField(name, cursor.value(cursor.scalar(4), name))
    return fields


def _check_layout(path: str, fields: dict[str, HeaderField], tensors: tuple[HeaderTensor, ...], end: int,
                  size: int) -> None:
    """The tensors' data one after another from the aligned end of the header, each padded to the alignment, as
    llama.cpp requires (its gguf.cpp refuses any other offset), and inside the file: no two overlap, none points
    outside. A truncated file is refused here, as gguf-py refuses it (its views of the tensor data would not fit)."""
    alignment = _alignment(path, fields)
    data_start = -(-end // alignment) * alignment
    expected, names = 0, set()
    for tensor in tensors:
        if tensor.name in names:
            raise GGUFError(path, f"duplicate tensor name {tensor.name!r}")
        names.add(tensor.name)
        if tensor.data_offset != expected:
            raise GGUFError(path, f"tensor {tensor.name!r} has data offset {tensor.data_offset}, expected {expected} "
                                  f"(tensors lie one after another, each padded to the alignment {alignment})")
        expected += -(-tensor.n_bytes // alignment) * alignment
    needed = max((data_start + t.data_offset + t.n_bytes for t in tensors), default=end)
    if needed > size:
        raise GGUFError(path, f"truncated: its tensors need {needed} bytes, the file has {size}")


def _alignment(path: str, fields: dict[str, HeaderField]) -> int:
    if "general.alignment" not in fields:
        return GGUF_DEFAULT_ALIGNMENT
    value = fields["general.alignment"].value
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_ALIGNMENT \
            or value & (value - 1):
        raise GGUFError(path, f"general.alignment is {value!r}, not a power of two from 1 to {MAX_ALIGNMENT}")
    return value


class _Cursor:
    def __init__(self, data, order: str, offset: int, path: str) -> None:
        self.data, self.order, self.offset, self.path = data, order, offset, path

    @property
    def left(self) -> int:
        return len(self.data) - self.offset

    def scalar(self, kind: int):
        fmt = self.order + _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def count(self, what: str, bound: int, min_item_bytes: int) -> int:
        """A u64 count of items that follow, each at least min_item_bytes long: at most `bound`, and no more than
        the rest of the file can hold."""
        value = self.scalar(10)
        if value > bound:
            raise GGUFError(self.path, f"{what} is {value}, above the bound {bound}")
        if value * min_item_bytes > self.left:
            raise GGUFError(self.path, f"truncated or corrupt GGUF header: {what} is {value}, more than the "
                                       f"{self.left} bytes left in the file can hold")
        return value

    def string(self, what: str, bound: int = MAX_STRING_BYTES) -> str:
        length = self.count(f"the length of {what}", bound, 1)
        start, self.offset = self.offset, self.offset + length
        try:
            return bytes(self.data[start:self.offset]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(self.path, f"{what} at byte {start} is not UTF-8 text") from None

    def value(self, kind: int, key: str):
        if kind == _STRING:
            return self.string(f"{key}'s value")
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind != _ARRAY:
            raise GGUFError(self.path, f"{key} has value type {kind}, not a GGUF type (0 to 12)")
        item = self.scalar(4)
        if item == _ARRAY or (item != _STRING and item not in _SCALARS):
            raise GGUFError(self.path, f"{key} is an array of type {item}, not of a GGUF scalar or string type "
                                       "(llama.cpp reads no arrays of arrays)")
        item_bytes = 8 if item == _STRING else struct.calcsize(_SCALARS[item])  # a string: its length at least
        count = self.count(f"{key}'s array length", MAX_ARRAY_ITEMS, item_bytes)
        array = _Array(self.path, self.order, item, self.offset, count)
        if item != _STRING:
            self.offset += count * item_bytes
            return array
        length = struct.Struct(self.order + "Q").unpack_from
        data, offset, end = self.data, self.offset, len(self.data)
        for _ in range(count):  # skipped now (the tokenizer's tens of thousands), decoded when asked for
            offset += 8 + length(data, offset)[0]
            if offset > end:
                raise GGUFError(self.path, f"truncated or corrupt GGUF header: {key}'s strings run past the end "
                                           "of the file")
        self.offset = offset
        return array

    def tensor(self) -> HeaderTensor:
        name = self.string("a tensor name", MAX_TENSOR_NAME_BYTES)
        n_dims = self.scalar(4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(self.path, f"tensor {name!r} has {n_dims} dimensions, not 1 to {MAX_DIMS}")
        shape = tuple(self.scalar(10) for _ in range(n_dims))
        n_elements = 1
        for n in shape:  # each dimension at most the file's size: no product of them overflows a u64 before it
            if not 1 <= n <= len(self.data):
                raise GGUFError(self.path, f"tensor {name!r} has dimension {n}, outside 1 to the file's size "
                                           f"{len(self.data)}")
            n_elements *= n
        kind = self.scalar(4)
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(self.path, f"tensor {name!r} has type {kind}, not a ggml type") from None
        if tensor_type in INTEGER_TYPES:
            raise GGUFError(self.path, f"tensor {name!r} has type {tensor_type.name}: a model's weights are floats or "
                                       "quantized blocks")
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if shape[0] % block_size:
            raise GGUFError(self.path, f"tensor {name!r} has rows of {shape[0]} elements, not whole blocks of "
                                       f"{block_size} ({tensor_type.name})")
        return HeaderTensor(name, tensor_type, shape, n_elements, n_elements * type_size // block_size,
                            self.scalar(10))
