"""The disk tier under a real llama.cpp context: a prompt evicted from the RAM cache, or seen before a restart, is
restored from its file and gets the KV and first tokens its first prefill gave; a file that is corrupt, of another
model or KV type, or another tenant's is a miss that computes the prompt, never wrong KV."""

import asyncio
import shutil

import numpy as np
import pytest

import prefill_cpu.prefiller as prefiller_module
from contracts.handoff import SamplingParams
from contracts.identity import read_gguf_identity
from prefill_cpu.disk_prefix import describe_tiers
from prefill_cpu.kv_disk_tier import kv_disk_folder
from prefill_cpu.prefill_worker import PrefillWorker
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

pytestmark = pytest.mark.slow  # llama.cpp contexts on tiny GGUFs, a few seconds
SEEDED = SamplingParams(temperature=1.0, seed=5, n=3, logprobs=3)
DOC = tuple(range(5, 85))  # 80 tokens: three chunks of 32
OTHER = tuple(range(100, 160))
MAX_KL = 0.01  # check-model's bound on a quantized KV's fidelity (edge/check_model/command.py)


def config(model, folder, kv_type="f16", **kw) -> PrefillConfig:
    return PrefillConfig(str(model), n_ctx=256, n_batch=32, n_threads=2, kv_type=kv_type, prefix_cache_tokens=512,
                         prefix_cache_entries=kw.pop("entries", 1), kv_disk_bytes=kw.pop("disk", 16 << 20),
                         kv_disk_dir=str(folder), **kw)


def run(prefiller: Prefiller, tokens, salt="t"):
    return prefiller.prefill(PrefillRequest("r", tuple(tokens), SEEDED, cache_salt=salt))


def finished(prefiller: Prefiller) -> None:
    prefiller.disk.flush()
    prefiller.close()


@pytest.fixture
def logits_seen(monkeypatch):
    """The last logits each prefill drew its first tokens from. # each [vocab] float32"""
    seen = []
    real = prefiller_module.sample_first

    def recording(logits, *args):
        seen.append(np.array(logits, copy=True))
        return real(logits, *args)

    monkeypatch.setattr(prefiller_module, "sample_first", recording)
    return seen


def test_a_prompt_evicted_from_ram_comes_back_from_disk(tiny_gguf, tmp_path):
    prefiller = Prefiller(config(tiny_gguf("llama", "f16"), tmp_path))  # one RAM entry: OTHER evicts DOC
    first = run(prefiller, DOC)
    run(prefiller, OTHER)
    prefiller.disk.flush()
    again = run(prefiller, DOC)
    assert again.cached_tokens == len(DOC) and prefiller.disk.stats().hits == 1
    assert prefiller.cache.num_evictions >= 1
    assert again.handoff.k_layers == first.handoff.k_layers and again.handoff.v_layers == first.handoff.v_layers
    assert again.handoff.first_tokens == first.handoff.first_tokens
    finished(prefiller)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_prompt_seen_before_a_restart_is_restored_not_computed(tiny_gguf, tmp_path, kv_type, logits_seen):
    model = tiny_gguf("llama", "f16")
    before = Prefiller(config(model, tmp_path, kv_type))
    first = run(before, DOC)
    finished(before)
    after = Prefiller(config(model, tmp_path, kv_type))  # the worker restarted: same model, config and folder
    assert after.disk.stats().entries == 1
    repeat = run(after, DOC)
    # the whole prompt from disk with its last logits: the same KV bytes and first tokens, bit for bit
    assert repeat.cached_tokens == len(DOC)
    assert repeat.handoff.k_layers == first.handoff.k_layers and repeat.handoff.v_layers == first.handoff.v_layers
    assert repeat.handoff.first_tokens == first.handoff.first_tokens
    assert len({t.token for t in first.handoff.first_tokens}) > 1
    question = DOC + (200, 201, 202, 203)
    asked = run(after, question, salt="t")
    finished(after)
    fresh = Prefiller(config(model, tmp_path / "none", kv_type, disk=0))
    computed = run(fresh, question)
    fresh.close()
    assert asked.cached_tokens == len(DOC) and computed.cached_tokens == 0
    restored, full = logits_seen[-2], logits_seen[-1]
    if kv_type == "f16":  # the same cells; the rest computed in another chunk, which llama.cpp rounds otherwise
        np.testing.assert_allclose(restored, full, atol=1e-4)
    else:
        assert np.argmax(restored) == np.argmax(full) and _kl(full, restored) <= MAX_KL


def test_a_corrupt_entry_is_a_miss_and_the_prompt_is_computed(tiny_gguf, tmp_path):
    model = tiny_gguf("llama", "f16")
    before = Prefiller(config(model, tmp_path))
    first = run(before, DOC)
    folder = before.disk.folder
    finished(before)
    (path,) = folder.iterdir()
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x01  # one bit of the last layer's V
    path.write_bytes(bytes(data))
    after = Prefiller(config(model, tmp_path))
    again = run(after, DOC)
    assert again.cached_tokens == 0 and after.disk.stats().rejected == 1
    assert [t.token for t in again.handoff.first_tokens] == [t.token for t in first.handoff.first_tokens]
    finished(after)


def test_entries_of_another_model_or_kv_type_are_rejected_at_start(tiny_gguf, tmp_path):
    llama = tiny_gguf("llama", "f16")
    q8 = Prefiller(config(llama, tmp_path, "q8_0"))
    run(q8, DOC)
    qwen = Prefiller(config(tiny_gguf("qwen2", "f16"), tmp_path))
    run(qwen, OTHER)
    folders = [q8.disk.folder, qwen.disk.folder]
    finished(q8)
    finished(qwen)
    target = kv_disk_folder(tmp_path, read_gguf_identity(str(llama)).fingerprint, "f16", "prefill-0")
    target.mkdir(parents=True)  # the llama f16 worker's own folder
    for folder in folders:
        for path in folder.iterdir():
            shutil.copy(path, target / path.name)
    f16 = Prefiller(config(llama, tmp_path))
    assert f16.disk.stats().rejected == 2 and f16.disk.stats().entries == 0
    assert run(f16, DOC).cached_tokens == 0 and run(f16, OTHER).cached_tokens == 0
    finished(f16)


def test_another_tenants_entry_is_a_miss_and_a_tenant_can_be_forgotten(tiny_gguf, tmp_path):
    model = tiny_gguf("llama", "f16")
    before = Prefiller(config(model, tmp_path, entries=2))
    run(before, DOC, salt="a")
    run(before, OTHER, salt="b")
    finished(before)
    after = Prefiller(config(model, tmp_path, entries=2))
    worker = PrefillWorker(after, "prefill-0", None)
    assert run(after, DOC, salt="b").cached_tokens == 0  # tenant a's prompt, asked by tenant b
    assert asyncio.run(worker.forget_salt("a"))[1] == 1
    assert run(after, DOC, salt="a").cached_tokens == 0  # forgotten, on disk and in RAM
    assert run(after, OTHER, salt="b").cached_tokens == len(OTHER)
    tiers = {tier.name: tier for tier in worker.cache_tiers()}
    assert tiers["disk"].hits == 1 and tiers["disk"].misses == 2 and tiers["ram"].misses == 3
    assert "disk: 1 hits (60 tokens), 2 misses" in describe_tiers(after)
    asyncio.run(worker.close_disk_tier())
    assert not after.disk.offer(DOC + (9,), "a", b"state", None)  # closed: dropped, never queued
    finished(after)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = _log_softmax(p_logits), _log_softmax(q_logits)
    return float(np.sum(np.exp(p) * (p - q)))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - np.max(x)
    return x - np.log(np.sum(np.exp(x)))
