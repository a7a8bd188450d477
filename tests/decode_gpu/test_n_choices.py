"""n > 1: one prefill, n choices forked in the paged pool (copy-on-write), each with its own seed stream.

The engine tests hold the fork to a strong standard: choice i of an n-choice request must give exactly the tokens a
lone request with choice i's first token and seed gives, which can only hold if every fork reads the prompt's KV
and no choice writes into another's blocks. The worker test checks the n first tokens, the server test the API.
"""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from contracts.events import FinishReason
from contracts.handoff import FirstToken, SamplingParams, choice_seed
from decode_gpu.core.block_manager import BlockManager
from decode_gpu.core.scheduler import Scheduler, SchedulerConfig
from decode_gpu.core.sequence import Sequence
from decode_gpu.engine import DecodeEngine, HandoffRejectedError
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from tiny_llama import tiny_engine_setup

SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=12)


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine_setup("cpu")


def _engine(tiny, **config) -> DecodeEngine:
    model, identity, _ = tiny
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="float32", **config),
                         torch.device("cpu"))
    return DecodeEngine(runner, eos_token_ids=(2,))


def _with_choices(handoff, sampling: SamplingParams, first_tokens: list[int]):
    return dataclasses.replace(handoff, sampling=dataclasses.replace(sampling, n=len(first_tokens)),
                               first_token=first_tokens[0],
                               other_choices=tuple(FirstToken(t) for t in first_tokens[1:]))


def _run(engine: DecodeEngine, handoffs) -> tuple[dict, list]:
    """Every (request, choice)'s tokens, and every event, from an engine run to the end."""
    outputs, events = {}, [e for h in handoffs for e in engine.add(h)]
    while engine.has_work:
        events += engine.step()
    for event in events:
        outputs.setdefault((event.request_id, event.index), []).extend(event.token_ids)
    return outputs, events


@pytest.mark.parametrize("prompt", [0, 1], ids=["mid-block", "on-a-block-boundary"])
def test_each_choice_decodes_what_a_lone_request_with_its_seed_decodes(tiny, prompt):
    handoff = tiny[2][prompt]  # prompts of 7 and 16 tokens: the first token lands mid-block or opens a block
    firsts = [40, 41, 42]
    engine = _engine(tiny)
    together, events = _run(engine, [_with_choices(handoff, SAMPLED, firsts)])
    alone = {}
    for i, first in enumerate(firsts):
        lone = dataclasses.replace(handoff, request_id=f"alone{i}", first_token=first,
                                   sampling=dataclasses.replace(SAMPLED, seed=choice_seed(SAMPLED.seed, i)))
        alone[i] = _run(_engine(tiny), [lone])[0][(f"alone{i}", 0)]
    for i in range(3):
        assert together[(handoff.request_id, i)] == alone[i], f"choice {i}"
    assert len({tuple(tokens) for tokens in alone.values()}) == 3  # the seed streams differ
    assert [e.finish_reason for e in events if e.finish_reason is not None] == [FinishReason.LENGTH]  # one end
    ends = sorted(e.index for e in events if (e.choice_finish or e.finish_reason) is not None)
    assert ends == [0, 1, 2]  # and one per choice
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()


def test_forks_share_the_prompt_blocks_and_copy_only_the_one_they_write(tiny):
    engine = _engine(tiny)
    handoff = _with_choices(tiny[2][2], SAMPLED, [40, 41, 42])  # 21 prompt tokens: one full block, one partial
    engine.add(handoff)
    engine.step()
    tables = [engine.blocks.block_tables[seq.seq_id] for seq in engine.requests[handoff.request_id]]
    assert len({table[0] for table in tables}) == 1  # the full prompt block is shared by all three
    assert len({table[1] for table in tables}) == 3  # the block each writes is its own
    assert engine.blocks.num_used_blocks == 4
    engine.blocks.check_integrity()


def test_a_choice_that_ends_at_its_first_token_leaves_the_others_running(tiny):
    engine = _engine(tiny)
    handoff = _with_choices(tiny[2][0], dataclasses.replace(SAMPLED, stop_token_ids=(41,)), [40, 41, 42])
    outputs, events = _run(engine, [handoff])
    assert outputs[(handoff.request_id, 1)] == [41]
    assert events[1].choice_finish == FinishReason.STOP and events[1].finish_reason is None
    assert len(outputs[(handoff.request_id, 0)]) == len(outputs[(handoff.request_id, 2)]) == SAMPLED.max_tokens
    assert sum(e.finish_reason is not None for e in events) == 1


def test_abort_ends_every_choice_with_one_event_and_frees_their_blocks(tiny):
    engine = _engine(tiny)
    handoff = _with_choices(tiny[2][1], SAMPLED, [40, 41, 42])
    engine.add(handoff)
    engine.step()
    engine.step()
    event = engine.abort(handoff.request_id)
    assert event.finish_reason == FinishReason.ABORT and not engine.has_work
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()


def test_more_choices_than_max_num_seqs_is_refused_by_name(tiny):
    from decode_gpu.engine import EngineConfig
    model, identity, handoffs = tiny
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="float32", max_num_seqs=2),
                         torch.device("cpu"))
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2)))
    with pytest.raises(HandoffRejectedError, match="max_num_seqs"):
        engine.add(_with_choices(handoffs[0], SAMPLED, [40, 41, 42]))


def test_the_scheduler_admits_a_request_only_with_room_for_every_choice():
    blocks = BlockManager(num_blocks=6, block_size=16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), blocks)
    other = Sequence("other", 0, 0, prompt_len=20, tokens=list(range(21)), sampling=SAMPLED)
    scheduler.add(other)
    scheduler.schedule()  # takes 2 blocks
    root = Sequence("r", 0, 1, prompt_len=40, tokens=list(range(41)), sampling=SAMPLED)
    root.forks = [Sequence(f"r#{i}", 0, 1, prompt_len=40, tokens=list(range(41)), sampling=SAMPLED,
                           request_id="r", index=i) for i in (1, 2)]
    scheduler.add(root)
    assert scheduler.schedule().imports == []  # 3 blocks for the prompt + a copy per fork > the 4 free
    scheduler.abort("other")
    step = scheduler.schedule()
    assert [seq.seq_id for seq, _ in step.imports] == ["r"] and len(step.copies) == 2
    assert sorted(seq.seq_id for seq in step.decode) == ["r", "r#1", "r#2"]
    assert blocks.num_free_blocks == 1
    blocks.check_integrity()


def test_the_worker_draws_n_reproducible_first_tokens(tiny_gguf):
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    prefiller = Prefiller(PrefillConfig(str(tiny_gguf("llama")), n_ctx=256, n_batch=64, n_threads=2, kv_type="f16"))
    try:
        def firsts(params):
            handoff = prefiller.prefill(PrefillRequest("r", tuple(range(5, 30)), params)).handoff
            return [first.token for first in handoff.first_tokens]
        params = SamplingParams(temperature=1.5, seed=11, n=8, logprobs=2)
        drawn = firsts(params)
        assert len(drawn) == 8 and len(set(drawn)) > 1  # own seed streams
        assert firsts(params) == drawn  # reproducible
        assert firsts(dataclasses.replace(params, n=1)) == drawn[:1]  # choice 0 samples as a lone request does
        handoff = prefiller.prefill(PrefillRequest("r", tuple(range(5, 30)), params)).handoff
        assert all(first.logprob is not None and len(first.top_logprobs) == 2 for first in handoff.first_tokens)
    finally:
        prefiller.close()


# --- through the server, with the official client ----------------------------------------------------------------

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_process import ServerProcess
    # seeded texts compared across runs and batches (two identical requests decoding side by side): deterministic
    # (one weight precision, batch-invariant matmuls and attention: auto's plan may hold q8_0 weights up to a batch
    # size and float32 above it, and float32 sgemm rounds by the row count) and no prompt cache
    config = ('max_num_seqs = 8\ndtype = "float32"\ndeterministic = true\nprefix_cache_tokens = 0\n'
              '[limits]\nshutdown_grace_s = 1.0\n')
    server = ServerProcess(config,
                           tmp_path_factory.mktemp("n_choices")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _three(client, seed: int):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}], n=3,
        temperature=1.0, seed=seed, max_tokens=16)
    return completion


@pytest.mark.slow
def test_n_3_returns_three_choices_that_differ_and_repeat_with_the_seed(client):
    first = _three(client, 5)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in _three(client, 5).choices] == texts
    assert 3 <= first.usage.completion_tokens <= 3 * 16  # every choice counted


@pytest.mark.slow
def test_streamed_choices_carry_their_index_and_end_once_each(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=3,
                                       max_tokens=10, stream=True, stream_options={"include_usage": True})
    texts, ends, usage = {0: "", 1: ""}, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                ends.append(choice.index)
    assert sorted(ends) == [0, 1]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=3,
                                      max_tokens=10)
    assert [c.text for c in whole.choices] == [texts[0], texts[1]]
    assert usage.completion_tokens == whole.usage.completion_tokens == 20


@pytest.mark.slow
def test_n_counts_toward_the_output_limit_and_max_num_seqs(server):
    too_many = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 9},
                          timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    over = httpx.post(server.base + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "hi", "n": 8, "max_tokens": 2000})
    assert over.status_code == 400 and "every choice" in over.json()["error"]["message"]


@pytest.mark.slow
def test_concurrent_n_requests_each_get_their_own_choices(client):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: _three(client, s), [1, 1, 2, 2]))
    texts = [[c.message.content for c in r.choices] for r in results]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert all(len(t) == 3 for t in texts)
