"""The Triton paged attention and KV store against the torch path: the CPU under Triton's interpreter, CUDA natively.

Each check runs one ragged batch through `paged_attention` on two pools with the same prior context, one
per backend, and compares the outputs and the pools after the store.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    # before triton is imported: kernels are interpreted only if this is set when they are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from decode_gpu.attention.backend import configured_backend  # noqa: E402
from decode_gpu.attention.paged_attention import paged_attention  # noqa: E402
from decode_gpu.attention.paged_batch import build_paged_batch  # noqa: E402
from decode_gpu.kv.pool import KVPool, PoolShape  # noqa: E402
from tiny_llama import greedy_tokens, tiny_engine_setup  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="kernels compiled for CUDA here")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRETED, reason="interpreted here")])]
BS, NUM_BLOCKS = 16, 24
# storage: (query dtype, relative error bound against the torch path)
STORAGE = {"float32": (torch.float32, 1e-5), "float16": (torch.float16, 2e-3),
           "bfloat16": (torch.bfloat16, 1e-2), "int8": (torch.float32, 1e-5), "int4": (torch.float32, 1e-5)}
# (context, new tokens) per sequence: ends on and off block boundaries, a padded row, and a 16-token query
# whose causal window crosses the boundary of the kernel's 32-key tiles and of its splits
RAGGED = [(16, 1), (17, 3), (140, 16), (0, 0), (5, 2), (64, 1)]
DECODE = [(16, 1), (130, 1), (0, 0), (5, 1)]


class _Layer(torch.nn.Module):
    layer_idx = 0


def _pool(storage: str, num_kv_heads: int, head_dim: int, device: str) -> KVPool:
    return KVPool(PoolShape(1, NUM_BLOCKS, BS, num_kv_heads, head_dim, storage), torch.device(device))


def _scattered_tables(seqs) -> list[list[int]]:
    """Non-contiguous block tables, each in descending block order."""
    free = list(range(NUM_BLOCKS))[::-1]
    return [[free.pop() for _ in range(-(-n_ctx // BS))][::-1] for n_ctx, _ in seqs]


def run_both(storage: str, n_heads: int, num_kv_heads: int, head_dim: int, seqs, device: str, num_splits: int,
             skip_last_store: bool = False, **extras):
    """Outputs [n_new, n_heads, head_dim] and pools of the torch and the triton path for one ragged batch.
    skip_last_store: the triton batch's last new token gets slot -1, as a static batch's pad row does."""
    gen = torch.Generator().manual_seed(n_heads * 1000 + head_dim)
    dtype = STORAGE[storage][0]
    tables = _scattered_tables(seqs)
    ctx, q_lens = [c for c, _ in seqs], [q for _, q in seqs]
    pools = {backend: _pool(storage, num_kv_heads, head_dim, device) for backend in ("torch", "triton")}
    prior = [n_ctx - n_q for n_ctx, n_q in seqs]
    old = build_paged_batch(pools["torch"], tables, prior, prior, torch.device(device), backend="torch")
    # [n_prior, num_kv_heads, head_dim]
    old_k = torch.randn(sum(prior), num_kv_heads, head_dim, generator=gen).to(device)
    old_v = torch.randn(sum(prior), num_kv_heads, head_dim, generator=gen).to(device)
    for pool in pools.values():
        pool.write(0, old.slot_mapping, old_k, old_v)
    n_new = sum(q_lens)
    # transformers' layouts: a transposed view of [1, n_new, heads, head_dim]
    # [1, n_heads, n_new, head_dim]
    q = torch.randn(1, n_new, n_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    # [1, num_kv_heads, n_new, head_dim]
    k = torch.randn(1, n_new, num_kv_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    v = torch.randn(1, n_new, num_kv_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    outs = {}
    for backend, pool in pools.items():
        batch = build_paged_batch(pool, tables, ctx, q_lens, torch.device(device), backend=backend,
                                  num_splits=num_splits)
        if skip_last_store and backend == "triton":
            slots = batch.slot_mapping.clone()  # [n_new]
            slots[-1] = -1
            batch = dataclasses.replace(batch, slot_mapping=slots)
        outs[backend] = paged_attention(_Layer(), q, k, v, None, scaling=head_dim ** -0.5, paged=batch, **extras)[0][0]
    return outs, pools


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    assert float((got.float() - want.float()).norm() / want.float().norm()) < bound


def assert_same_pools(a: KVPool, b: KVPool) -> None:
    for x, y in zip(a._all_tensors(), b._all_tensors()):
        assert torch.equal(x, y)


# every storage meets every GQA group; head sizes and split counts alternate across them
CASES = [(storage, group, head_dim, splits)
         for i, storage in enumerate(STORAGE)
         for j, (group, head_dim) in enumerate([(1, 128), (3, 64), (4, 64 if i % 2 else 128)])
         for splits in [(1, 4)[(i + j) % 2]]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage,group,head_dim,splits", CASES, ids=[f"{c[0]}-g{c[1]}-d{c[2]}-s{c[3]}" for c in CASES])
def test_ragged_batch_matches_torch(device, storage, group, head_dim, splits):
    num_kv_heads = 2
    outs, pools = run_both(storage, group * num_kv_heads, num_kv_heads, head_dim, RAGGED, device, splits)
    assert_close(outs["triton"], outs["torch"], STORAGE[storage][1])
    assert_same_pools(pools["triton"], pools["torch"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_batch_matches_torch(device, storage, splits):
    outs, pools = run_both(storage, 8, 2, 64, DECODE, device, splits)
    assert_close(outs["triton"], outs["torch"], STORAGE[storage][1])
    assert_same_pools(pools["triton"], pools["torch"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage,head_dim,splits", [("float32", 256, 1), ("bfloat16", 64, 4), ("int8", 256, 2)])
def test_sliding_window_and_soft_capping_match_torch(device, storage, head_dim, splits):
    """Gemma's options: a 20-position window (the 16-token query of the 140-token context spans tiles and splits
    the window skips) and soft-capped scores, in both paths; each option changes the output, so both bite."""
    outs, pools = run_both(storage, 4, 2, head_dim, RAGGED, device, splits, sliding_window=20, softcap=1.0)
    assert_close(outs["triton"], outs["torch"], STORAGE[storage][1])
    assert_same_pools(pools["triton"], pools["torch"])
    for extras in (dict(sliding_window=20), dict(softcap=1.0)):
        other, _ = run_both(storage, 4, 2, head_dim, RAGGED, device, splits, **extras)
        difference = float((other["triton"].float() - outs["triton"].float()).norm())
        assert difference > 0.1 * float(outs["torch"].float().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_pad_row_with_a_negative_slot_stores_nothing_and_changes_no_other_row(device):
    seqs = DECODE + [(1, 1)]  # the pad row last: one token, its own block (a scratch block in a static batch)
    outs, pools = run_both("int8", 4, 2, 64, seqs, device, 2, skip_last_store=True)
    assert_close(outs["triton"][:-1], outs["torch"][:-1], STORAGE["int8"][1])
    scratch = _scattered_tables(seqs)[-1][0]
    for ours, theirs in zip(pools["triton"]._all_tensors(), pools["torch"]._all_tensors()):
        assert not ours[scratch].any() and theirs[scratch].any()  # only the torch path wrote the pad token
        theirs[scratch] = 0
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_splits_agree_and_tiles_smaller_than_a_block(device):
    """One split, many splits (some empty for short contexts), and 16-key tiles give the same output."""
    from decode_gpu.attention.triton_attention import paged_attention_triton
    outs, pools = run_both("float32", 4, 1, 64, RAGGED, device, 1)
    pool = pools["triton"]
    q = torch.randn(outs["torch"].shape, generator=torch.Generator().manual_seed(1)).to(device)  # [n_new, 4, 64]
    ctx, q_lens = [c for c, _ in RAGGED], [n for _, n in RAGGED]
    batch = build_paged_batch(pool, _scattered_tables(RAGGED), ctx, q_lens, torch.device(device), backend="triton")
    args = (q, pool.k[0], pool.v[0], None, None, batch.block_tables, batch.context_lens, batch.query_start,
            batch.query_lens, batch.max_query_len)
    one = paged_attention_triton(*args, 1, 0.125)
    assert_close(paged_attention_triton(*args, 8, 0.125), one, 1e-5)
    assert_close(paged_attention_triton(*args, 2, 0.125, block_n=16), one, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", list(STORAGE))
def test_store_matches_kv_pool_write_and_skips_negative_slots(device, storage):
    from decode_gpu.attention.triton_store import store_kv
    gen = torch.Generator().manual_seed(2)
    n_kv, head_dim = 3, 64
    ours, want = _pool(storage, n_kv, head_dim, device), _pool(storage, n_kv, head_dim, device)
    slots = torch.tensor([5, -1, 17, 300, -1, 0], dtype=torch.int32, device=device)  # [n]
    # [n, n_kv, head_dim], strided
    keys = 4 * torch.randn(n_kv, len(slots), head_dim, generator=gen).to(device).transpose(0, 1)
    values = torch.randn(len(slots), n_kv, head_dim, generator=gen).to(device)  # [n, n_kv, head_dim]
    keys[2, 1] = 0.0  # an all-zero group: the scale's floor, not a division by zero
    scales = (ours.k_scale[0], ours.v_scale[0]) if ours.k_scale else (None, None)
    store_kv(ours.k[0], ours.v[0], *scales, slots, ours.rotate_k(keys), values)  # as the Triton path stores them
    kept = slots >= 0
    want.write(0, slots[kept], keys[kept], values[kept])
    assert_same_pools(ours, want)  # the skipped rows wrote nothing: everything else is still zero
    assert ours.k[0].flatten(0, 1)[slots[kept].long()].float().abs().sum() > 0  # [n kept, n_kv, row bytes or elements]


@pytest.fixture
def attention_backend(monkeypatch):
    """Sets EDGE_ATTENTION_BACKEND for the engine; the setting is read once, so the cache is cleared around it."""
    def use(name: str) -> None:
        monkeypatch.setenv("EDGE_ATTENTION_BACKEND", name)
        configured_backend.cache_clear()
    yield use
    monkeypatch.undo()
    configured_backend.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["float32", "int8", "int4"])
@pytest.mark.slow
def test_engine_greedy_tokens_same_on_both_paths(device, storage, attention_backend, monkeypatch):
    import decode_gpu.attention.paged_attention as attention
    calls = []  # layers run through the Triton kernels
    real = attention._triton_attention
    monkeypatch.setattr(attention, "_triton_attention", lambda *args: calls.append(1) or real(*args))
    model, identity, handoffs = tiny_engine_setup(device)
    attention_backend("torch")
    want = greedy_tokens(model, identity, handoffs, device, storage)
    assert not calls
    attention_backend("triton")
    got = greedy_tokens(model, identity, handoffs, device, storage)
    assert calls
    assert {h.request_id: len(want[h.request_id]) for h in handoffs} == \
        {h.request_id: h.sampling.max_tokens for h in handoffs}
    assert got == want


# Compiled for NVIDIA targets with Triton's bundled ptxas, no GPU needed: the interpreter accepts code
# that the compiler rejects (non-constexpr globals, dot shapes), and register spills show only here.
COMPILED = [  # (arch, query dtype, pool dtype, GQA group, head size, max query tokens, splits, soft-capping)
    (90, "bf16", "bf16", 4, 128, 1, 4, False), (90, "bf16", "i8", 8, 128, 16, 1, False),
    (90, "fp32", "fp32", 3, 64, 4, 1, False), (90, "fp16", "fp16", 1, 64, 1, 1, False),
    (80, "bf16", "i8", 4, 128, 1, 2, False), (90, "bf16", "bf16", 2, 256, 1, 2, True),  # the last: Gemma 2
    (90, "bf16", "i4", 4, 128, 1, 4, False), (90, "bf16", "i4", 8, 128, 16, 1, False)]  # int4: "i4" = packed *u8
_PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "i8": "*i8", "i4": "*u8"}
_BITS = {"i8": 8, "i4": 4}  # quantized pool types: QUANT_BITS (float pools: 0)


def _compile(fn, arch: int, pointers: dict, constexprs: dict, options: dict) -> str:
    """Compile one kernel specialization; returns cuobjdump's resource line (registers, stack)."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    floats = ("scale_log2", "softcap")
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
                 for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True)
    return next(line.strip() for line in usage.stdout.splitlines() if "REG:" in line)


def _compile_all() -> None:
    from decode_gpu.attention import triton_attention as ta
    from decode_gpu.attention import triton_store as ts
    for arch, qd, pd, group, head_dim, max_q, splits, softcap in COMPILED:
        tiles = ta._tiles(group, max_q, head_dim, None)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[qd]
        scales = "*fp16" if pd in _BITS else _PTR[pd]
        pointers = {"q": _PTR[qd], "out": _PTR[qd], "k_pool": _PTR[pd], "v_pool": _PTR[pd], "k_scales": scales,
                    "v_scales": scales, "mid_out": "*fp32", "mid_lse": "*fp32", "block_tables": "*i32",
                    "context_lens": "*i32", "query_start": "*i32", "query_lens": "*i32"}
        constexprs = dict(tiles, BLOCK_SIZE=16, NUM_SPLITS=splits, QUANT_BITS=_BITS.get(pd, 0), GROUP_SIZE=32,
                          HAS_SOFTCAP=softcap, **ta._dot_options(dtype))
        print(f"attention sm_{arch} {qd}/{pd} group {group} head {head_dim} query {max_q} splits {splits}:",
              _compile(ta._paged_attention_kernel, arch, pointers, constexprs, ta._launch_options(tiles, dtype)))
    print("merge:", _compile(ta._merge_splits_kernel, 90, {"mid_out": "*fp32", "mid_lse": "*fp32", "out": "*bf16"},
                             dict(NUM_SPLITS=4, HEAD_DIM=128, HEAD_DIM_P2=128), {}))
    for pd in ("i8", "i4", "bf16"):
        pointers = {"new_k": "*fp16", "new_v": "*fp16", "slots": "*i32", "k_pool": _PTR[pd], "v_pool": _PTR[pd],
                    "k_scales": "*fp16", "v_scales": "*fp16"}
        print(f"store {pd}:", _compile(ts._store_kv_kernel, 90, pointers,
                                       dict(HEAD_DIM=128, HEAD_DIM_P2=128, QUANT_BITS=_BITS.get(pd, 0), N_GROUPS_P2=4,
                                            GROUP_SIZE=32), {}))


@pytest.mark.slow
def test_kernels_compile_for_the_gpu_without_spills():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    usage = [line for line in done.stdout.splitlines() if "REG:" in line]
    assert len(usage) == len(COMPILED) + 4, done.stdout
    assert all(" STACK:0 " in line and " LOCAL:0 " in line for line in usage), done.stdout


if __name__ == "__main__":  # the compile check's subprocess: kernels defined without the interpreter
    _compile_all()


@pytest.mark.skipif(not INTERPRETED, reason="needs llama.cpp for the handoffs, which a GPU check machine lacks")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.slow
def test_gemma_engine_greedy_tokens_same_on_both_paths(arch, attention_backend, tiny_gguf, conversion_cache):
    """Sliding windows and soft-capping through the whole engine: the Triton path decodes the torch path's tokens
    from a llama.cpp handoff of a prompt longer than the window."""
    from contracts.handoff import SamplingParams
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import load_decode_model
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    path = tiny_gguf(arch)
    identity = read_gguf_identity(str(path))
    model = load_decode_model(identity, torch.device("cpu"), torch.float32, conversion_cache)
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=128, n_threads=2, kv_type="f16"))
    try:
        handoff = prefiller.prefill(PrefillRequest("r", tuple(range(3, 43)), SamplingParams(temperature=0.0,
                                                                                             max_tokens=8))).handoff
    finally:
        prefiller.close()
    attention_backend("torch")
    want = greedy_tokens(model, identity, [handoff], "cpu", "float32")
    attention_backend("triton")
    assert greedy_tokens(model, identity, [handoff], "cpu", "float32") == want
