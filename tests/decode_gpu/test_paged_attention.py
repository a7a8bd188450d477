"""Paged attention equals dense attention on ragged batches, for every storage dtype."""

import math

import pytest
import torch

from decode_gpu.attention.paged_attention import paged_attention
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.kv.pool import KVPool, PoolShape

N_HEADS, N_KV, D, BS = 4, 2, 64, 16
CASES = {  # storage: relative error bound against fp32 dense attention
    "float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2, "int8": 2e-2, "int4": 0.15,
}


class _Layer(torch.nn.Module):
    layer_idx = 0


def dense_attention(q, k, v, n_ctx, n_q):
    """q: [n_q, H, D]; k, v: [n_ctx, n_kv, D]; causal with the queries at the end of the context."""
    k = k.repeat_interleave(N_HEADS // N_KV, dim=1)
    v = v.repeat_interleave(N_HEADS // N_KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    allowed = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n_q, n_ctx)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("storage", CASES)
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [3, 1, 5, 2]], ids=["decode", "ragged-queries"])
def test_paged_equals_dense(storage, query_lens):
    torch.manual_seed(0)
    context_lens = [16, 17, 33, 5]  # ends on and off block boundaries
    pool = KVPool(PoolShape(1, num_blocks=16, block_size=BS, num_kv_heads=N_KV, head_dim=D, storage=storage),
                  torch.device("cpu"))
    free = list(reversed(range(16)))  # scattered, non-contiguous block tables
    tables = [[free.pop() for _ in range(-(-n // BS))][::-1] for n in context_lens]
    ks = [torch.randn(n, N_KV, D) for n in context_lens]
    vs = [torch.randn(n, N_KV, D) for n in context_lens]
    qs = [torch.randn(n_q, N_HEADS, D) for n_q in query_lens]
    # the context before this step is already in the pool
    for table, k, v, n_ctx, n_q in zip(tables, ks, vs, context_lens, query_lens):
        old = build_paged_batch(pool, [table], [n_ctx - n_q], [n_ctx - n_q], torch.device("cpu"))
        pool.write(0, old.slot_mapping, k[: n_ctx - n_q], v[: n_ctx - n_q])
    batch = build_paged_batch(pool, tables, context_lens, query_lens, torch.device("cpu"))
    new_k = torch.cat([k[n - q:] for k, n, q in zip(ks, context_lens, query_lens)])  # [n_new, N_KV, D]
    new_v = torch.cat([v[n - q:] for v, n, q in zip(vs, context_lens, query_lens)])
    out, _ = paged_attention(_Layer(), torch.cat(qs).transpose(0, 1)[None], new_k.transpose(0, 1)[None],
                             new_v.transpose(0, 1)[None], None, scaling=1 / math.sqrt(D), paged=batch)
    want = torch.cat([dense_attention(q, k, v, n, len(q)) for q, k, v, n in zip(qs, ks, vs, context_lens)])
    got = out[0]
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < CASES[storage]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("window", [None, 7])
def test_grouped_attention_equals_gqa(dtype, n_heads, n_kv, window):
    """The query heads of a KV head stacked as rows under an additive mask (the CPU path's layout) give what
    SDPA's own GQA gives under the boolean mask, sliding windows and padded query rows included."""
    from decode_gpu.attention.torch_attention import _attend, _attend_grouped, _mask
    torch.manual_seed(0)
    context_lens, query_lens = [16, 17, 33, 5], [3, 1, 5, 2]
    pool = KVPool(PoolShape(1, num_blocks=16, block_size=BS, num_kv_heads=n_kv, head_dim=D, storage="float32"),
                  torch.device("cpu"))
    tables = [[4 * i + b for b in range(-(-n // BS))] for i, n in enumerate(context_lens)]
    batch = build_paged_batch(pool, tables, context_lens, query_lens, torch.device("cpu"), backend="torch")
    span = batch.query_mask.shape[-1]
    q = torch.randn(len(tables), n_heads, max(query_lens), D, dtype=dtype)
    k, v = (torch.randn(len(tables), n_kv, span, D, dtype=dtype) for _ in range(2))
    want = _attend(q, k, v, _mask(batch, window)[:, None], D ** -0.5, None)
    got = _attend_grouped(batch, q, k, v, window, D ** -0.5)
    valid = batch.query_valid[:, None, :, None].expand_as(want)  # padded query rows are dropped by the caller
    assert torch.allclose(got[valid].float(), want[valid].float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 9])
def test_multi_token_queries_of_different_lengths_attend_in_groups_with_the_same_result(storage, window, monkeypatch):
    """A ragged multi-token batch (speculative verification) whose contexts differ a lot is attended in groups of
    similar length on the CPU, each padded to its own longest context: the same result as one group."""
    from decode_gpu.attention import length_groups as length_groups_module
    from decode_gpu.attention.length_groups import length_groups
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    torch.manual_seed(0)
    context_lens, query_lens = [20, 300, 17, 5, 290, 33], [3, 5, 1, 2, 4, 1]
    num_blocks = 48
    pool = KVPool(PoolShape(1, num_blocks=num_blocks, block_size=BS, num_kv_heads=N_KV, head_dim=D, storage=storage),
                  torch.device("cpu"))
    pool.write(0, torch.arange(num_blocks * BS), torch.randn(num_blocks * BS, N_KV, D),
               torch.randn(num_blocks * BS, N_KV, D))
    free = list(reversed(range(num_blocks)))
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in context_lens]
    batch = build_paged_batch(pool, tables, context_lens, query_lens, torch.device("cpu"), backend="torch")
    assert len(batch.groups) == len(length_groups(context_lens, BS)) > 1
    n_new = sum(query_lens)
    q = torch.randn(1, N_HEADS, n_new, D).to(dtype)
    new_k, new_v = (torch.randn(1, N_KV, n_new, D).to(dtype) for _ in range(2))
    got, _ = paged_attention(_Layer(), q, new_k, new_v, None, scaling=D ** -0.5, paged=batch, sliding_window=window)
    monkeypatch.setattr(length_groups_module, "MAX_GROUPS", 1)  # the same sequences as one group
    together = build_paged_batch(pool, tables, context_lens, query_lens, torch.device("cpu"), backend="torch")
    assert not together.groups
    want, _ = paged_attention(_Layer(), q, new_k, new_v, None, scaling=D ** -0.5, paged=together,
                              sliding_window=window)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("contexts", [[40], [33, 33, 33]], ids=["one-row", "equal-lengths"])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0)])
def test_equal_length_decode_rows_attend_unmasked_and_on_one_thread_as_the_masked_path_does(contexts, window, softcap,
                                                                                            monkeypatch):
    """Rows whose contexts are all equally long (a batch of one) get their gathered blocks cut to that length and no
    mask, on one thread when that small; the masked path over the padded span gives the same, and the thread count
    is back as it was after each layer."""
    from contracts.handoff import SamplingParams
    from decode_gpu.core.sequence import Sequence
    from decode_gpu.runner.step_inputs import StepInputs
    num_blocks = 12
    pool = KVPool(PoolShape(1, num_blocks, BS, N_KV, D, "float32"), torch.device("cpu"))
    generator = torch.Generator().manual_seed(4)
    pool.write(0, torch.arange(num_blocks * BS), *(torch.randn(num_blocks * BS, N_KV, D, generator=generator)
                                                   for _ in range(2)))
    order = torch.randperm(num_blocks - 1, generator=generator).tolist()
    seqs = [Sequence(f"s{i}", 0, i, n - 1, [1] * n, SamplingParams(), num_cached=n - 1) for i, n in enumerate(contexts)]
    tables = [[order.pop() for _ in range(-(-n // BS))] for n in contexts]
    inputs = StepInputs(pool, num_blocks - 1, capacity=4, max_blocks=8, device=torch.device("cpu"), backend="torch")
    rows = len(seqs)
    inputs.fill(seqs, tables, rows)
    exact = inputs.batch(rows, 100)  # a longer max_context than any row's: the cut follows the rows' own length
    assert exact.decode_len == contexts[0] and exact.decode_mask is None
    q, new_k, new_v = (torch.randn(1, heads, rows, D, generator=generator) for heads in (N_HEADS, N_KV, N_KV))
    threads = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.append(n), set_threads(n)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    got, _ = paged_attention(_Layer(), q, new_k, new_v, None, paged=exact, sliding_window=window, softcap=softcap)
    assert threads == [1, 2]
    monkeypatch.setattr(StepInputs, "_equal_length", lambda *args: None)
    masked = inputs.batch(rows, 100)
    assert masked.decode_len is None and masked.decode_mask is not None
    want, _ = paged_attention(_Layer(), q, new_k, new_v, None, paged=masked, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
