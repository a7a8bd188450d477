"""Hostile and corrupt GGUFs are refused by the header check (contracts.gguf_check) with a message naming what is
wrong, each within seconds, never with another exception; the embedded model and every fixture pass.

The mutants are copies of the embedded model's header (tests/hostile_gguf.py): named changes to its counts, lengths,
types, dimensions, offsets and hyperparameters, cuts, and seeded byte flips."""

from __future__ import annotations

import random
import time
from pathlib import Path

import gguf
import pytest

from contracts.gguf_check import check_gguf
from contracts.gguf_header import GGUFError, read_header
from contracts.identity import UnsupportedModelError, check_supported
from hostile_gguf import layout, write_copy
from tiny_embedding_gguf import tiny_bert_gguf
from tiny_gguf import ARCHS

# A check takes about 25 ms on the dev machine; 30 s leaves a busy machine room and still catches a check that
# loops over one of the mutants' counts of 1 << 40 (hours), the thing this limit is for.
LIMIT_S = 30.0
BIG = 1 << 40


@pytest.fixture(scope="module")
def embedded(embedded_model_path):
    return layout(Path(embedded_model_path))


def refused(path: Path) -> str:
    """The check's message for `path`, which it must refuse within LIMIT_S with a GGUFError (any other exception
    fails the test)."""
    began = time.monotonic()
    with pytest.raises(GGUFError) as info:
        check_gguf(str(path))
    assert time.monotonic() - began < LIMIT_S
    assert str(info.value).startswith(f"{path}: ") and info.value.reason
    return info.value.reason


def meaning(header) -> tuple:
    return {key: field.contents() for key, field in header.fields.items()}, header.tensors


def test_the_embedded_model_and_every_fixture_pass(embedded_model_path, tiny_gguf):
    for path in [embedded_model_path, *(tiny_gguf(arch) for arch in ARCHS), tiny_gguf("llama", "f16"),
                 tiny_bert_gguf("embed"), tiny_bert_gguf("rank")]:
        assert check_gguf(str(path)).tensors


def test_a_copy_of_the_header_alone_passes_as_the_model_does(embedded, embedded_model_path, tmp_path):
    """The method's baseline: the header with a hole for the tensor data reads as the real file."""
    copy = write_copy(tmp_path / "copy.gguf", embedded.header, embedded.size)
    assert meaning(check_gguf(str(copy))) == meaning(read_header(embedded_model_path))


def _key(name, part):
    return lambda lay: getattr(lay.keys[name], part)


def _tensor(index, part, dim=None):
    return lambda lay: getattr(lay.tensors[index], part) if dim is None else lay.tensors[index].dims[dim]


def _named(lay, name: str):
    return next(t for t in lay.tensors if t.name == name)


# (id, where, new value, words of the message)
NUMBERS = [
    ("tensor-count-huge", lambda lay: lay.num_tensors, 1 << 62, "the tensor count is 4611686018427387904, above"),
    ("tensor-count-within-the-bound", lambda lay: lay.num_tensors, 60000, ""),
    ("tensor-count-one-more", lambda lay: lay.num_tensors, 273, ""),
    ("key-count-huge", lambda lay: lay.num_fields, BIG, "the metadata key count is 1099511627776, above"),
    ("key-count-one-more", lambda lay: lay.num_fields, 34, ""),
    ("key-length-huge", _key("general.architecture", "length"), BIG, "the length of a metadata key"),
    ("string-length-huge", _key("general.name", "value"), BIG, "the length of general.name's value"),
    ("string-length-into-the-tensors", _key("tokenizer.chat_template", "value"), 1 << 23, ""),
    ("value-type-unknown", _key("general.name", "type"), 13, "general.name has value type 13"),
    ("array-of-arrays", _key("tokenizer.ggml.token_type", "item_type"), 9, "array of type 9"),
    ("array-item-type-unknown", _key("tokenizer.ggml.token_type", "item_type"), 77, "array of type 77"),
    ("token-array-huge", _key("tokenizer.ggml.tokens", "count"), BIG, "tokenizer.ggml.tokens's array length"),
    ("token-array-above-the-bound", _key("tokenizer.ggml.tokens", "count"), (1 << 21) + 1, "above the bound"),
    ("number-array-longer", _key("tokenizer.ggml.token_type", "count"), 1 << 21, ""),
    ("tensor-name-long", _tensor(5, "name_length"), 200, "the length of a tensor name is 200, above the bound 63"),
    ("tensor-dims-5", _tensor(3, "n_dims"), 5, "has 5 dimensions"),
    ("tensor-dims-0", _tensor(3, "n_dims"), 0, "has 0 dimensions"),
    ("tensor-dim-huge", _tensor(0, "dims", 1), BIG, "has dimension 1099511627776"),
    ("tensor-dim-zero", _tensor(1, "dims", 0), 0, "has dimension 0"),
    ("tensor-dim-partial-block", _tensor(0, "dims", 0), 577, "not whole blocks of 32"),
    ("tensor-dim-one-more-row", lambda lay: _named(lay, "blk.0.attn_q.weight").dims[1], 577, "data offset"),
    ("tensor-type-unknown", _tensor(2, "type"), 99, "has type 99, not a ggml type"),
    ("tensor-type-integer", _tensor(20, "type"), 26, "has type I32"),
    ("tensor-type-larger", _tensor(20, "type"), 28, "data offset"),
    ("tensor-offset-misaligned", _tensor(4, "offset"), None, "data offset"),
    ("tensor-offset-overlapping", _tensor(4, "offset"), 0, "data offset"),
    ("tensor-offset-outside", _tensor(4, "offset"), BIG, "data offset"),
    ("last-tensor-past-the-end", _tensor(-1, "dims", 0), 576 * 64, "truncated: its tensors need"),
]


@pytest.mark.parametrize("where,value,words", [n[1:] for n in NUMBERS], ids=[n[0] for n in NUMBERS])
def test_a_hostile_number_in_the_header_is_refused(embedded, tmp_path, where, value, words):
    place = where(embedded)
    value = embedded.value_at(place) + 32 * 7 + 1 if value is None else value
    assert words in refused(write_copy(tmp_path / "m.gguf", embedded.with_value(place, value), embedded.size))


HPARAMS = [
    ("layers-100000", "llama.block_count", 100_000, "llama.block_count is 100000, above the bound 1024"),
    ("layers-one-more", "llama.block_count", 31, "llama.block_count is 31, but the file's layer tensors (blk.N.*) "
                                                 "are for layers 0 to 29 (30 layers)"),
    ("layers-fewer", "llama.block_count", 12, "llama.block_count is 12, but"),
    ("layers-zero", "llama.block_count", 0, "llama.block_count is 0, below the least 1"),
    ("heads-zero", "llama.attention.head_count", 0, "llama.attention.head_count is 0, below the least 1"),
    ("heads-huge", "llama.attention.head_count", 100_000, "llama.attention.head_count is 100000, above the bound"),
    ("kv-heads-huge", "llama.attention.head_count_kv", 1 << 31, "head_count_kv is 2147483648, above the bound 1024"),
    ("width-huge", "llama.embedding_length", 1 << 30, "llama.embedding_length is 1073741824, above the bound 65536"),
    ("width-not-the-embedding", "llama.embedding_length", 512, "embedding_length is 512, but token_embd.weight is "
                                                               "576 wide"),
    ("context-huge", "llama.context_length", 0xFFFFFFFF, "llama.context_length is 4294967295, above the bound"),
    ("vocab-size-huge", "llama.vocab_size", 1 << 30, "llama.vocab_size is 1073741824, above the bound"),
    ("rope-dims-huge", "llama.rope.dimension_count", 1 << 30, "rope.dimension_count is 1073741824, above"),
]


@pytest.mark.parametrize("key,value,words", [h[1:] for h in HPARAMS], ids=[h[0] for h in HPARAMS])
def test_a_hostile_model_number_is_refused_by_name_value_and_bound(embedded, tmp_path, key, value, words):
    header = embedded.with_value(embedded.keys[key].value, value)
    assert words in refused(write_copy(tmp_path / "m.gguf", header, embedded.size))


def test_a_token_list_that_is_not_the_embedding_is_refused(embedded, tmp_path):
    """One token fewer (its bytes left as the next key's): refused, by the vocabulary or the misread that follows."""
    header = embedded.with_value(embedded.keys["tokenizer.ggml.tokens"].count, 49151)
    refused(write_copy(tmp_path / "m.gguf", header, embedded.size))


@pytest.mark.parametrize("cut", [0, 3, 7, 23, 100, 1107, 500_000, -40, -1])
def test_a_header_cut_short_is_refused(embedded, tmp_path, cut):
    size = cut if cut >= 0 else len(embedded.header) + cut
    assert refused(write_copy(tmp_path / "m.gguf", embedded.header, size))


@pytest.mark.parametrize("cut", [1785664, 50_000_000, 98362432 - 1])
def test_a_file_cut_inside_its_tensor_data_is_refused(embedded, tmp_path, cut):
    assert "truncated" in refused(write_copy(tmp_path / "m.gguf", embedded.header, cut))


@pytest.mark.parametrize("magic,version,words", [(b"GGUX", 3, "not a GGUF file"), (b"GGUF", 1, "version 1"),
                                                 (b"GGUF", 4, "version 4"), (b"GGUF", 0x7FFFFFFF, "version")])
def test_a_wrong_magic_or_version_is_refused(embedded, tmp_path, magic, version, words):
    header = magic + version.to_bytes(4, "little") + embedded.header[8:]
    assert words in refused(write_copy(tmp_path / "m.gguf", header, embedded.size))


def test_a_duplicate_tensor_name_is_refused(embedded, tmp_path):
    q, k = (next(t for t in embedded.tensors if t.name == f"blk.0.attn_{x}.weight") for x in "qk")
    header = bytearray(embedded.header)
    start = k.name_length.offset + 8
    header[start:start + len(q.name)] = q.name.encode()
    assert "duplicate tensor name 'blk.0.attn_q.weight'" in refused(write_copy(tmp_path / "m.gguf", bytes(header),
                                                                               embedded.size))


def _flips(embedded, tmp_path, seed: int, count: int, places) -> list[tuple[str, object]]:
    """(what was flipped, the check's GGUFError or the header it accepted) for `count` seeded flips."""
    rng, outcomes = random.Random(seed), []
    for i in range(count):
        offset, width = places(rng)
        header = bytearray(embedded.header)
        at = offset + rng.randrange(width)
        header[at] ^= rng.randrange(1, 256)
        path = write_copy(tmp_path / f"flip-{i}.gguf", bytes(header), embedded.size)
        began = time.monotonic()
        try:
            outcome = check_gguf(str(path))
        except GGUFError as err:
            outcome = err
        assert time.monotonic() - began < LIMIT_S, at
        outcomes.append((f"byte {at}", outcome))
        path.unlink()
    return outcomes


def test_seeded_flips_of_the_headers_structure_are_refused_unless_harmless(embedded, embedded_model_path, tmp_path):
    """A flip in a count, length, type tag, dimension or offset is refused, or (an unsigned type for a signed one of
    the same size) leaves the header meaning what it meant."""
    places = embedded.structural()
    outcomes = _flips(embedded, tmp_path, 48, 120, lambda rng: (lambda p: (p.offset, p.width))(rng.choice(places)))
    original = meaning(read_header(embedded_model_path))
    accepted = [(what, got) for what, got in outcomes if not isinstance(got, GGUFError)]
    assert all(meaning(got) == original for _, got in accepted), [what for what, _ in accepted]
    assert len(accepted) <= len(outcomes) // 10


def test_seeded_flips_anywhere_in_the_header_never_escape_the_check(embedded, tmp_path):
    """Most of the header is the tokenizer's text, which no check can tell from other text: a flip there may be
    accepted; what matters is that every flip ends as a pass or a GGUFError, in time (_flips holds both)."""
    outcomes = _flips(embedded, tmp_path, 5, 60, lambda rng: (rng.randrange(len(embedded.header)), 1))
    assert len(outcomes) == 60


def test_alignment_must_be_a_power_of_two(tmp_path, tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf("llama"))
    for alignment, words in ((0, "general.alignment is 0"), (48, "general.alignment is 48")):
        writer = gguf.GGUFWriter(str(tmp_path / f"a{alignment}.gguf"), "llama")
        writer.add_uint32("general.alignment", alignment)
        for tensor in reader.tensors[:2]:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert words in refused(tmp_path / f"a{alignment}.gguf")


def _with_array(src: Path, dst: Path, key: str, values: list[int]) -> Path:
    """A copy of `src` with the metadata `key` an array of u32 `values`."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == key:
            writer.add_array(key, values)
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_per_layer_head_counts_are_checked_then_refused_by_the_handoff(tmp_path, tiny_gguf):
    wrong = _with_array(tiny_gguf("llama"), tmp_path / "two.gguf", "llama.attention.head_count_kv", [2, 2])
    assert "llama.attention.head_count_kv has 2 values, one a layer, but block_count is 3" in refused(wrong)
    per_layer = _with_array(tiny_gguf("llama"), tmp_path / "three.gguf", "llama.attention.head_count_kv", [2, 2, 2])
    with pytest.raises(UnsupportedModelError, match="head_count_kv differs by layer"):
        check_supported(str(per_layer))
