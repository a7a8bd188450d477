"""The KV cache storage types llama.cpp can export, as both sides of the handoff understand them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVDType:
    name: str  # our wire name: "f16", "q8_0", "q4_0"
    ggml_type: int  # enum ggml_type value in ggml.h (llama-cpp-python 0.3.36)
    block_elems: int  # elements per quantization block (1 for plain floats)
    block_bytes: int  # bytes per block

    @property
    def quantized(self) -> bool:
        return self.block_elems > 1

    def row_bytes(self, n_elems: int) -> int:
        if n_elems % self.block_elems:
            raise ValueError(f"{self.name}: row of {n_elems} elements is not a multiple of {self.block_elems}")
        return n_elems // self.block_elems * self.block_bytes


# q8_0 block: f16 scale + 32 int8; q4_0 block: f16 scale + 16 bytes of nibbles (value = (q - 8) * scale).
KV_DTYPES: dict[str, KVDType] = {
    "f16": KVDType("f16", ggml_type=1, block_elems=1, block_bytes=2),
    "q8_0": KVDType("q8_0", ggml_type=8, block_elems=32, block_bytes=34),
    "q4_0": KVDType("q4_0", ggml_type=2, block_elems=32, block_bytes=18),
}
_BY_GGML_TYPE = {d.ggml_type: d for d in KV_DTYPES.values()}


def kv_dtype(name: str) -> KVDType:
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV cache type {name!r}; expected one of {sorted(KV_DTYPES)}") from None


def kv_dtype_for_ggml_type(ggml_type: int) -> KVDType:
    try:
        return _BY_GGML_TYPE[ggml_type]
    except KeyError:
        known = {d.name: d.ggml_type for d in KV_DTYPES.values()}
        raise ValueError(f"llama.cpp KV uses ggml type {ggml_type}, which the handoff does not carry; "
                         f"known: {known}") from None
