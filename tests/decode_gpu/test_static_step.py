"""The static decode step: persistent step inputs with padded rows, the torch path's block-gather decode
attention, KV sizing arithmetic and graph buckets on the CPU; CUDA graphs, host syncs and a golden run on a GPU."""

import dataclasses

import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.attention.paged_attention import paged_attention
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.core.sequence import Sequence
from decode_gpu.kv.pool import KVPool, PoolShape
from decode_gpu.runner.cuda_graphs import graph_buckets
from decode_gpu.runner.kv_sizing import GIB, MemoryProfile, kv_budget_bytes
from decode_gpu.runner.step_inputs import StepInputs
from tiny_llama import greedy_tokens, tiny_engine_setup

BS, NUM_BLOCKS, N_HEADS, N_KV, HEAD_DIM = 16, 20, 6, 2, 64
SCRATCH = NUM_BLOCKS - 1
CONTEXTS = [16, 1, 33, 100]  # context lengths after this step: on and off block boundaries
gpu = pytest.mark.gpu


class _Layer(torch.nn.Module):
    layer_idx = 0


def _sequences(contexts: list[int]) -> tuple[list[Sequence], list[list[int]]]:
    """Sequences about to decode their last context token, with block tables scattered over the pool."""
    order = torch.randperm(SCRATCH, generator=torch.Generator().manual_seed(1)).tolist()  # never the scratch block
    seqs, tables = [], []
    for i, n_ctx in enumerate(contexts):
        tokens = [(7 * i + p) % 50 + 1 for p in range(n_ctx)]
        seqs.append(Sequence(f"s{i}", 0, i, n_ctx - 1, tokens, SamplingParams(), num_cached=n_ctx - 1))
        tables.append([order.pop() for _ in range(-(-n_ctx // BS))])
    return seqs, tables


def _pool(storage: str) -> KVPool:
    pool = KVPool(PoolShape(1, NUM_BLOCKS, BS, N_KV, HEAD_DIM, storage), torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    slots = torch.arange(NUM_BLOCKS * BS)
    keys, values = (torch.randn(len(slots), N_KV, HEAD_DIM, generator=generator) for _ in range(2))
    pool.write(0, slots, keys, values)
    return pool


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test_block_gather_decode_equals_the_dense_path_and_pad_rows_touch_only_the_scratch_block(storage):
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    seqs, tables = _sequences(CONTEXTS)
    rows = len(seqs) + 3  # padded as a CUDA graph bucket would be
    generator = torch.Generator().manual_seed(3)
    q, new_k, new_v = (torch.randn(1, heads, rows, HEAD_DIM, generator=generator).to(dtype)
                       for heads in (N_HEADS, N_KV, N_KV))

    ours, want = _pool(storage), _pool(storage)
    inputs = StepInputs(ours, SCRATCH, capacity=8, max_blocks=4, device=torch.device("cpu"), backend="torch")
    longest = inputs.fill(seqs, tables, rows)
    assert longest == max(CONTEXTS)
    assert inputs.input_ids[:len(seqs)].tolist() == [s.tokens[-1] for s in seqs]
    assert inputs.slots[len(seqs):rows].tolist() == [SCRATCH * BS] * 3
    got, _ = paged_attention(_Layer(), q, new_k, new_v, None, paged=inputs.batch(rows, longest))

    n = len(seqs)
    dense = build_paged_batch(want, tables, CONTEXTS, [1] * n, torch.device("cpu"), backend="torch")
    expected, _ = paged_attention(_Layer(), q[:, :, :n], new_k[:, :, :n], new_v[:, :, :n], None, paged=dense)
    torch.testing.assert_close(got[:, :n], expected)  # the same math over a longer (masked) span
    for a, b in zip(ours.k + ours.v, want.k + want.v):  # the real rows stored the same; padding only the scratch block
        torch.testing.assert_close(a[:SCRATCH], b[:SCRATCH], rtol=0, atol=0)
        assert not torch.equal(a[SCRATCH], b[SCRATCH])


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 24])
def test_rows_of_different_lengths_attend_in_groups_with_the_same_result(storage, window, monkeypatch):
    """Short contexts beside a long one: the CPU path attends them in groups of similar length, each padded to
    its own longest context, and gets what one group padded to the longest gets (sliding windows too)."""
    from decode_gpu.attention import length_groups as length_groups_module
    from decode_gpu.attention.length_groups import length_groups
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    contexts = [20, 290, 17, 33, 1, 20, 31]
    num_blocks = 48
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)).tolist()
    seqs, tables = [], []
    for i, n_ctx in enumerate(contexts):
        tokens = [(7 * i + p) % 50 + 1 for p in range(n_ctx)]
        seqs.append(Sequence(f"s{i}", 0, i, n_ctx - 1, tokens, SamplingParams(), num_cached=n_ctx - 1))
        tables.append([order.pop() for _ in range(-(-n_ctx // BS))])
    pool = KVPool(PoolShape(1, num_blocks, BS, N_KV, HEAD_DIM, storage), torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    pool.write(0, torch.arange(num_blocks * BS), *(torch.randn(num_blocks * BS, N_KV, HEAD_DIM, generator=generator)
                                                   for _ in range(2)))
    inputs = StepInputs(pool, num_blocks - 1, capacity=8, max_blocks=19, device=torch.device("cpu"), backend="torch")
    longest = inputs.fill(seqs, tables, len(seqs))
    grouped = inputs.batch(len(seqs), longest)
    assert len(grouped.groups) == len(length_groups(contexts, BS)) > 1
    assert sorted(r for rows, _ in grouped.groups for r in rows.tolist()) == list(range(len(seqs)))
    q, new_k, new_v = (torch.randn(1, heads, len(seqs), HEAD_DIM, generator=generator).to(dtype)
                       for heads in (N_HEADS, N_KV, N_KV))
    got, _ = paged_attention(_Layer(), q, new_k, new_v, None, paged=grouped, sliding_window=window)
    monkeypatch.setattr(length_groups_module, "MAX_GROUPS", 1)  # the same rows as one group
    together = inputs.batch(len(seqs), longest)
    assert not together.groups
    want, _ = paged_attention(_Layer(), q, new_k, new_v, None, paged=together, sliding_window=window)
    torch.testing.assert_close(got, want)


def test_length_groups_split_only_where_padding_costs_more_than_a_group():
    from decode_gpu.attention.length_groups import GROUP_COST_TOKENS, MAX_GROUPS, length_groups
    assert length_groups([256] * 16, 16) == [list(range(16))]  # equal lengths: one group
    assert length_groups([300] * 15 + [1100], 16) == [list(range(15)), [15]]
    assert length_groups([5, 40], 16) == [[0, 1]]  # padding 32 tokens costs less than a group
    assert len(length_groups([16 * GROUP_COST_TOKENS * (i + 1) for i in range(8)], 16)) == MAX_GROUPS


def test_step_inputs_grow_for_a_batch_past_their_capacity():
    seqs, tables = _sequences(CONTEXTS)
    inputs = StepInputs(_pool("float32"), SCRATCH, capacity=2, max_blocks=1, device=torch.device("cpu"),
                        backend="torch")
    inputs.fill(seqs, tables, len(seqs))
    assert (inputs.capacity, inputs.max_blocks, inputs.generation) == (4, 7, 1)
    assert inputs.block_tables[2, :3].tolist() == tables[2]
    assert inputs.context_lens[:4].tolist() == CONTEXTS


def test_graph_buckets_cover_every_batch_up_to_max_num_seqs():
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(5) == [1, 2, 4, 8]
    assert graph_buckets(1) == [1]
    for max_num_seqs in range(1, 70):
        buckets = graph_buckets(max_num_seqs)
        assert all(any(b >= n for b in buckets) for n in range(1, max_num_seqs + 1))
        assert buckets[-1] < max_num_seqs + 8


def test_kv_budget_is_a_share_of_total_memory_minus_weights_peak_and_others():
    profile = MemoryProfile(total=80 * GIB, free=60 * GIB, torch_allocated=16 * GIB, torch_reserved=18 * GIB,
                            peak_activation=2 * GIB)
    assert profile.non_torch == 2 * GIB  # 80 - 60 - 18
    assert kv_budget_bytes(profile, 0.9, 1024) == int(72 * GIB) - 16 * GIB - 2 * GIB - 2 * GIB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*weights 70.00 GiB"):
        kv_budget_bytes(dataclasses.replace(profile, torch_allocated=70 * GIB), 0.9, 1024)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(profile, 1.5, 1024)


def test_cpu_decode_uses_half_its_threads_while_a_prompt_is_in_prefill():
    from decode_gpu.core.priority_gate import PriorityGate
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    model, identity, _ = tiny_engine_setup("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        gate = PriorityGate(enabled=True)
        runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512), torch.device("cpu"), gate)
        seqs, tables = _sequences([5, 17])
        block_tables = {s.seq_id: t for s, t in zip(seqs, tables)}
        gate.hold(3)  # a prompt of priority 3 is queued: the gateway says so
        runner.forward(seqs, block_tables)
        assert torch.get_num_threads() == 2
        gate.hold(None)
        runner.forward(seqs, block_tables)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records tensor-to-host reads (what would sync with a GPU): item, tolist, bool(tensor), .cpu(), ..."""
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_forward_reads_nothing_back_to_the_host():
    """The CPU stand-in for the GPU's sync check: a registered mask function once made transformers read a
    packed-sequence test back every forward (a host sync per step on CUDA, and no graph capture)."""
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    model, identity, _ = tiny_engine_setup("cpu")
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512), torch.device("cpu"))
    seqs, tables = _sequences([5, 17, 40])
    block_tables = {s.seq_id: t for s, t in zip(seqs, tables)}
    runner.forward(seqs, block_tables)
    with _HostReads() as reads:
        runner.forward(seqs, block_tables)
    assert reads.seen == []


# --- on a GPU -------------------------------------------------------------------------------------------


@gpu
def test_graph_replay_gives_the_eager_tokens():
    model, identity, handoffs = tiny_engine_setup("cuda")
    sampled = dataclasses.replace(handoffs[0], request_id="sampled",
                                  sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8))
    handoffs = [*handoffs, sampled]
    eager = greedy_tokens(model, identity, handoffs, "cuda", "float32", enforce_eager=True)
    graphed = greedy_tokens(model, identity, handoffs, "cuda", "float32")
    assert graphed == eager


@gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_host_sync_inside_the_forward(enforce_eager):
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    model, identity, _ = tiny_engine_setup("cuda")
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, enforce_eager=enforce_eager,
                                                       max_num_seqs=8), torch.device("cuda"))
    assert (runner.graphs is None) == enforce_eager
    seqs, tables = _sequences([5, 17, 40])
    block_tables = {s.seq_id: t for s, t in zip(seqs, tables)}
    runner.forward(seqs, block_tables)  # warm-up (eager: Triton compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.forward(seqs, block_tables)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()


@gpu
def test_golden_run_matches_transformers_generate():
    """The engine (Triton attention, CUDA graphs) against transformers' own greedy generate on the same model."""
    model, identity, handoffs = tiny_engine_setup("cuda")
    got = greedy_tokens(model, identity, handoffs, "cuda", "float32")
    for h in handoffs:
        prompt = torch.tensor([h.prompt_tokens], device="cuda")
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=h.sampling.max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        assert got[h.request_id] == out[0, len(h.prompt_tokens):].tolist(), h.request_id


@gpu
def test_kv_pool_sized_from_total_memory():
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    model, identity, _ = tiny_engine_setup("cuda")
    total = torch.cuda.mem_get_info()[1]
    runner = ModelRunner(model, identity, RunnerConfig(gpu_memory_utilization=0.05, max_num_seqs=8),
                         torch.device("cuda"))
    pool_bytes = runner.num_blocks * BS * runner.pool.shape.bytes_per_token()
    assert 0 < pool_bytes <= 0.05 * total
