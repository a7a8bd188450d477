"""deterministic = true: a sequence's greedy tokens do not depend on the batch it shares or on preemption. Eight
sequences decoded together under a pool that forces preemption (swap) give exactly the tokens each gives alone, with
bfloat16 and with int4 weights, on the CPU's torch path.

The logits test is the fast lane's check, and its negative control shows it bites: in float32 the default numerics
(length groups, matmuls of any row count: BLAS picks its kernel by row count) change some row's logits between a
batch and the rows alone. (This CPU's bfloat16 kernels happen to be row-count-invariant; an AMX CPU's or a GPU's are
not, and the weight plan's switch of precision by batch size is not either.)"""

import dataclasses

import pytest
import torch

from contracts.handoff import SamplingParams
from contracts.identity import GGUFIdentity
from decode_gpu.core.sequence import Sequence
from decode_gpu.engine import DecodeEngine
from decode_gpu.model.fused_projections import fuse_projections
from decode_gpu.model.native_decoder import DETERMINISTIC_ROWS, fixed_rows
from decode_gpu.model.weight_plan import WeightPlan
from decode_gpu.model.weight_quant import _one_precision, quantize_model
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from tiny_llama import handoff, tiny_engine_setup

CPU = torch.device("cpu")
NEW_TOKENS = 24
PROMPT_LENS = (5, 9, 14, 17, 23, 30, 41, 48)  # ends before, on and after block boundaries; lengths far apart


@pytest.fixture(scope="module")
def tiny_float():
    model, identity, _ = tiny_engine_setup("cpu")
    handoffs = [dataclasses.replace(handoff(model, identity, f"r{i}", list(range(3 + i, 3 + i + n))),
                                    sampling=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
                for i, n in enumerate(PROMPT_LENS)]
    fuse_projections(model)  # as load_weights does
    return model, identity, handoffs


def _weights(model, weights: str):
    import copy
    model = copy.deepcopy(model).to(torch.float32 if weights == "float32" else torch.bfloat16)
    if weights == "int4":
        quantize_model(model, "int4", CPU, torch.bfloat16)
    return model


def _run(model, identity, handoffs, kv_tokens: int, deterministic: bool = True) -> tuple[dict, int]:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=kv_tokens, kv_storage="auto",
                                                       deterministic=deterministic, forward="native"), CPU)
    engine = DecodeEngine(runner)
    out: dict[str, list[int]] = {}
    for event in [e for h in handoffs for e in engine.add(h)]:
        out.setdefault(event.request_id, []).extend(event.token_ids)
    while engine.has_work:
        for event in engine.step():
            assert event.error is None
            out.setdefault(event.request_id, []).extend(event.token_ids)
    return out, engine.scheduler.num_preemptions


@pytest.mark.slow  # about 12 s each on 2 shared cores
@pytest.mark.parametrize("weights", ["bfloat16", "int4", "float32"])
def test_concurrent_sequences_under_preemption_give_their_solo_answers(tiny_float, weights):
    model, identity, handoffs = tiny_float
    model = _weights(model, weights)
    solo = {h.request_id: _run(model, identity, [h], 256)[0][h.request_id] for h in handoffs}
    # 8 sequences of up to 48 + 24 tokens in a pool of 160: some are swapped out and back in
    together, preemptions = _run(model, identity, handoffs, 160)
    assert preemptions > 0
    assert together == solo


def _row_logits(model, identity, dtype: torch.dtype, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode step (ModelRunner.forward, the engine's own path) of 8 sequences of PROMPT_LENS
    contexts (random KV), together and each alone. # both [8, vocab]"""
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="auto",
                                                       deterministic=deterministic), CPU)
    bs = runner.pool.shape.block_size
    tables, start = {}, 0
    for i, n in enumerate(PROMPT_LENS):
        tables[f"s{i}"] = list(range(start, start + -(-(n + 1) // bs)))
        start += len(tables[f"s{i}"])
    generator = torch.Generator().manual_seed(0)
    for table in tables.values():  # random KV in every block a sequence reads
        slots = torch.tensor([b * bs + o for b in table for o in range(bs)])
        keys, values = (torch.randn(len(slots), identity.num_kv_heads, identity.head_dim_k,
                                    generator=generator).to(dtype) for _ in range(2))
        for layer in range(identity.n_layer):
            runner.pool.write(layer, slots, keys, values)
    seqs = [Sequence(f"s{i}", 0, i, n, [3] * n + [7 + i], SamplingParams(), num_cached=n)
            for i, n in enumerate(PROMPT_LENS)]

    def logits(rows: list[Sequence]) -> torch.Tensor:
        out = runner.forward(rows, tables).clone()
        for seq in rows:  # the step wrote each row's new K/V at its position: the next call writes the same again
            seq.num_cached = seq.prompt_len
        return out

    return logits(seqs), torch.cat([logits([seq]) for seq in seqs])


def _tiny_gemma2():
    """A random-weight Gemma 2: soft-capped attention scores and a sliding window (8) shorter than most contexts."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=320, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=64, sliding_window=8,
                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=256)
    model = Gemma2ForCausalLM(config).eval()
    fuse_projections(model)
    identity = GGUFIdentity(path="tiny-gemma2", fingerprint="sha256:tiny-gemma2", arch="gemma2", n_layer=2, n_head=6,
                            num_kv_heads=2, head_dim_k=64, head_dim_v=64, rope_layout="neox", sliding_window=8,
                            swa_layers=(0,))
    return model, identity


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int4", "gemma2 float32", "gemma2 bfloat16"])
def test_a_rows_logits_do_not_depend_on_the_batch(tiny_float, weights):
    """Each row's logits alone and beside seven others of other lengths, with and without deterministic: equal with
    it; in float32 without it (length groups, row counts) some row differs (the negative control). Gemma 2's rows
    take the soft-capped path, under a sliding window."""
    model, identity, _ = tiny_float
    if weights.startswith("gemma2"):
        model, identity = _tiny_gemma2()
        weights = weights.split()[1]
    model = _weights(model, weights)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    differs = {}
    for deterministic in (True, False):
        together, alone = _row_logits(model, identity, dtype, deterministic)
        differs[deterministic] = int((together != alone).any(-1).sum())
    assert differs[True] == 0
    if weights == "float32" and identity.arch == "llama":
        assert differs[False] > 0, "float32 happens to be batch-invariant here: the control shows nothing"


def test_fixed_rows_computes_each_row_in_blocks_of_the_same_size():
    calls = []
    weight = torch.randn(5, 3)

    def product(x):
        calls.append(x.shape[0])
        return x @ weight.T

    x = torch.randn(11, 3)
    assert torch.allclose(fixed_rows(product, x, 4), x @ weight.T)
    assert calls == [4, 4, 4]


def test_deterministic_implies_the_native_forward_swap_and_no_speculation():
    from contracts.process_config import EngineProcessConfig
    from decode_gpu.service.server import deterministic_config
    wiring = {"model": "m.gguf", "listen": "unix:/tmp/x.sock"}
    asked = EngineProcessConfig(**wiring, deterministic=True, preemption_mode="recompute",
                                decode_forward="transformers", speculative="ngram")
    got = deterministic_config(asked)
    assert (got.decode_forward, got.preemption_mode, got.speculative) == ("native", "swap", "off")
    plain = EngineProcessConfig(**wiring, preemption_mode="recompute")
    assert deterministic_config(plain) is plain
    with pytest.raises(ValueError, match="deterministic decoding needs the native forward"):
        ModelRunner(torch.nn.Module(), None, RunnerConfig(deterministic=True, forward="transformers"), CPU)


def test_deterministic_holds_the_precision_its_plan_uses_for_eight_rows():
    """Every deterministic product is of DETERMINISTIC_ROWS rows: the plan's precision at that size, at every size."""
    assert DETERMINISTIC_ROWS == 8
    floats = _one_precision(WeightPlan("int4", "measured", float_above=4, packed={"x": 1}, head_int8=True))
    assert (floats.weight_dtype, floats.float_above, floats.packed) == ("float", None, {"x": 1})
    assert "float weights at every batch size" in floats.why
    quantized = _one_precision(WeightPlan("int4", "measured", float_above=8, head_int8=True))
    assert (quantized.weight_dtype, quantized.float_above, quantized.head_int8) == ("int4", None, True)
