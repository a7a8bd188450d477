"""The handoff wire format: round trip, versioning, size checks, and refusal of a foreign model's KV."""

import dataclasses

import msgspec
import pytest

from contracts.handoff import HandoffFormatError, KVHandoff, KVLayout, SamplingParams, decode_handoff, encode_handoff
from contracts.identity import GGUFIdentity
from decode_gpu.kv.importer import HandoffMismatchError, check_handoff_matches

LAYOUT = KVLayout(n_layer=2, num_kv_heads=2, head_dim_k=64, head_dim_v=64, k_dtype="q8_0", v_dtype="q8_0",
                  v_transposed=False, k_rotation=64, v_rotation=64, rope_layout="interleaved")
IDENTITY = GGUFIdentity(path="/models/a.gguf", fingerprint="sha256:aa", arch="llama", n_layer=2, n_head=4,
                        num_kv_heads=2, head_dim_k=64, head_dim_v=64, rope_layout="interleaved")


def make_handoff(n_tokens=3, **changes) -> KVHandoff:
    row = 4 * 34  # 128 elements of q8_0
    fields = dict(request_id="req-1", model_fingerprint="sha256:aa", layout=LAYOUT,
                  positions=tuple(range(n_tokens)), prompt_tokens=tuple(range(10, 10 + n_tokens)), first_token=7,
                  k_layers=(b"\1" * row * n_tokens, b"\2" * row * n_tokens),
                  v_layers=(b"\3" * row * n_tokens, b"\4" * row * n_tokens),
                  sampling=SamplingParams(temperature=0.5, top_k=5, seed=3, stop=("END",)), priority=-2)
    fields.update(changes)
    return KVHandoff(**fields)


def test_round_trip_is_exact():
    handoff = make_handoff()
    assert decode_handoff(encode_handoff(handoff)) == handoff


def test_wire_carries_quantized_bytes_not_floats():
    handoff = make_handoff(n_tokens=16)
    assert len(encode_handoff(handoff)) < handoff.payload_bytes + 1024


def test_refuses_other_version():
    body = msgspec.msgpack.decode(encode_handoff(make_handoff()))
    body["version"] = 99
    with pytest.raises(HandoffFormatError, match="version 99"):
        decode_handoff(msgspec.msgpack.encode(body))


def test_refuses_garbage_and_truncation():
    with pytest.raises(HandoffFormatError):
        decode_handoff(b"\xc1not msgpack")
    data = encode_handoff(make_handoff())
    with pytest.raises(HandoffFormatError):
        decode_handoff(data[: len(data) // 2])


def test_refuses_layer_bytes_that_do_not_match_the_layout():
    bad = make_handoff(k_layers=(b"\1" * 10, b"\2" * 10))
    with pytest.raises(HandoffFormatError, match="layer 0: K 10"):
        decode_handoff(encode_handoff(bad))


def test_refuses_missing_fields():
    body = msgspec.msgpack.decode(encode_handoff(make_handoff()))
    del body["handoff"]["first_token"]
    with pytest.raises(HandoffFormatError, match="first_token"):
        decode_handoff(msgspec.msgpack.encode(body))


def test_refuses_fields_of_the_wrong_type():
    body = msgspec.msgpack.decode(encode_handoff(make_handoff()))
    body["handoff"]["sampling"]["max_tokens"] = "many"
    with pytest.raises(HandoffFormatError, match="max_tokens"):
        decode_handoff(msgspec.msgpack.encode(body))


def test_accepts_matching_model():
    check_handoff_matches(make_handoff(), IDENTITY)


@pytest.mark.parametrize("change,message", [
    (dict(fingerprint="sha256:bb"), "model fingerprint: handoff 'sha256:aa', decode model 'sha256:bb'"),
    (dict(n_layer=3), "layers: handoff 2, decode model 3"),
    (dict(num_kv_heads=4), "KV heads: handoff 2, decode model 4"),
    (dict(head_dim_k=128, head_dim_v=128), "K head size: handoff 64, decode model 128"),
    (dict(rope_layout="neox"), "RoPE layout"),
])
def test_refuses_other_model(change, message):
    with pytest.raises(HandoffMismatchError, match=message.replace("(", r"\(")):
        check_handoff_matches(make_handoff(), dataclasses.replace(IDENTITY, **change))
