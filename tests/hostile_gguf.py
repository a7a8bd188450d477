"""Mutated copies of a GGUF for the hostile-file tests: where every structural number of its header lies (walked
here with struct, independently of contracts.gguf_header), and copies with one of them changed, cut short, or a
byte flipped.

A copy is the header region, rewritten, then the file extended to its original size as a sparse hole: the check
reads the header only, so a 98 MB model's copy costs its 1.8 MB header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Place:
    offset: int
    width: int  # bytes: 4 or 8


@dataclass
class KeyPlaces:
    length: Place  # the key's length
    type: Place
    value: Place | None = None  # a scalar's value, or a string value's length
    item_type: Place | None = None  # an array's
    count: Place | None = None  # an array's
    is_string: bool = False


@dataclass
class TensorPlaces:
    name: str
    name_length: Place
    n_dims: Place
    dims: list[Place]
    type: Place
    offset: Place


@dataclass
class Layout:
    header: bytes  # the file up to its data section
    size: int  # the whole file's
    num_tensors: Place = Place(8, 8)
    num_fields: Place = Place(16, 8)
    keys: dict[str, KeyPlaces] = field(default_factory=dict)
    tensors: list[TensorPlaces] = field(default_factory=list)

    def structural(self) -> list[Place]:
        """Every count, length, type tag, dimension and offset: the numbers a reader trusts to find the rest."""
        places = [self.num_tensors, self.num_fields]
        for key in self.keys.values():
            places += [p for p in (key.length, key.type, key.item_type, key.count) if p is not None]
            if key.value is not None and key.is_string:
                places.append(key.value)  # a string's length; a number's value is no structure
        for tensor in self.tensors:
            places += [tensor.name_length, tensor.n_dims, *tensor.dims, tensor.type, tensor.offset]
        return places

    def with_value(self, place: Place, value: int) -> bytes:
        data = bytearray(self.header)
        data[place.offset:place.offset + place.width] = value.to_bytes(place.width, "little")
        return bytes(data)

    def value_at(self, place: Place) -> int:
        return int.from_bytes(self.header[place.offset:place.offset + place.width], "little")


def layout(path: Path) -> Layout:
    """A little-endian GGUF v3's header, walked."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 22)
        size = fh.seek(0, 2)
    assert head[:4] == b"GGUF" and struct.unpack_from("<I", head, 4)[0] == 3
    num_tensors, num_fields = struct.unpack_from("<QQ", head, 8)
    found = Layout(b"", size)
    at = 24
    for _ in range(num_fields):
        length = struct.unpack_from("<Q", head, at)[0]
        name = head[at + 8:at + 8 + length].decode()
        places = KeyPlaces(Place(at, 8), Place(at + 8 + length, 4))
        at += 8 + length
        kind = struct.unpack_from("<I", head, at)[0]
        at += 4
        if kind == ARRAY:
            item, count = struct.unpack_from("<IQ", head, at)
            places.item_type, places.count = Place(at, 4), Place(at + 4, 8)
            at += 12
            for _ in range(count):
                at += 8 + struct.unpack_from("<Q", head, at)[0] if item == STRING else _SIZES[item]
        elif kind == STRING:
            places.value, places.is_string = Place(at, 8), True
            at += 8 + struct.unpack_from("<Q", head, at)[0]
        else:
            places.value = Place(at, _SIZES[kind]) if _SIZES[kind] in (4, 8) else None
            at += _SIZES[kind]
        found.keys[name] = places
    for _ in range(num_tensors):
        length = struct.unpack_from("<Q", head, at)[0]
        name = head[at + 8:at + 8 + length].decode()
        name_length = Place(at, 8)
        at += 8 + length
        n_dims_place, n_dims = Place(at, 4), struct.unpack_from("<I", head, at)[0]
        dims = [Place(at + 4 + 8 * i, 8) for i in range(n_dims)]
        at += 4 + 8 * n_dims
        found.tensors.append(TensorPlaces(name, name_length, n_dims_place, dims, Place(at, 4), Place(at + 4, 8)))
        at += 12
    data_start = -(-at // 32) * 32
    found.header = head[:data_start]
    return found


def write_copy(path: Path, header: bytes, size: int) -> Path:
    """`header`, then zeros (a sparse hole) up to `size`; cut at `size` if the header is longer."""
    with open(path, "wb") as fh:
        fh.write(header[:size])
        fh.truncate(size)
    return path
