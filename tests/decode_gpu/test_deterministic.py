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
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.engine import DecodeEngine
from decode_gpu.model.fused_projections import fuse_projections
from decode_gpu.model.native_decoder import fixed_rows
from decode_gpu.model.weight_quant import quantize_model
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
    """The logits of one decode step of 8 sequences of PROMPT_LENS contexts (random KV), together and each alone.
    # both [8, vocab]"""
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="auto",
                                                       deterministic=deterministic), CPU)
    bs = runner.pool.shape.block_size
    tables, start = [], 0
    for n in PROMPT_LENS:
        tables.append(list(range(start, start + -(-(n + 1) // bs))))
        start += len(tables[-1])
    generator = torch.Generator().manual_seed(0)
    for table in tables:  # random KV in every block a sequence reads
        slots = torch.tensor([b * bs + o for b in table for o in range(bs)])
        keys, values = (torch.randn(len(slots), identity.num_kv_heads, identity.head_dim_k,
                                    generator=generator).to(dtype) for _ in range(2))
        for layer in range(identity.n_layer):
            runner.pool.write(layer, slots, keys, values)
    ids, positions = torch.arange(7, 7 + len(tables)), torch.tensor(PROMPT_LENS)

    def logits(rows: list[int]) -> torch.Tensor:
        paged = build_paged_batch(runner.pool, [tables[i] for i in rows], [PROMPT_LENS[i] + 1 for i in rows],
                                  [1] * len(rows), CPU, "torch", deterministic=deterministic)
        return runner.native(ids[rows], positions[rows], paged)

    return logits(list(range(len(tables)))), torch.cat([logits([i]) for i in range(len(tables))])


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int4"])
def test_a_rows_logits_do_not_depend_on_the_batch(tiny_float, weights):
    """Each row's logits alone and beside seven others of other lengths, with and without deterministic: equal with
    it; in float32 without it (length groups, row counts) some row differs (the negative control)."""
    model, identity, _ = tiny_float
    model = _weights(model, weights)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    differs = {}
    for deterministic in (True, False):
        together, alone = _row_logits(model, identity, dtype, deterministic)
        differs[deterministic] = int((together != alone).any(-1).sum())
    assert differs[True] == 0
    if weights == "float32":
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
