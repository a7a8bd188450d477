"""The prefill worker's prompt cache shares cells only between prompts of one cache salt."""

from prefill_cpu.prefix_cache import PrefixCache

PROMPT = tuple(range(100, 160))


def test_a_prompt_reuses_a_cached_prefix_of_its_own_salt_only():
    cache = PrefixCache([1, 2, 3], max_tokens=1000)
    seq_id, _ = cache.place(PROMPT, salt="tenant-a")
    assert cache.match(PROMPT + (7, 8), salt="tenant-a") == (seq_id, len(PROMPT))
    assert cache.match(PROMPT + (7, 8), salt="tenant-b") == (None, 0)
    assert cache.match(PROMPT + (7, 8)) == (None, 0)  # unsalted is a salt of its own too


def test_an_extending_prompt_replaces_only_its_own_salts_entry():
    cache = PrefixCache([1, 2, 3], max_tokens=1000)
    a, _ = cache.place(PROMPT, salt="a")
    b, evicted = cache.place(PROMPT + (1, 2, 3), salt="b")
    assert evicted == [] and {a, b} == set(cache.entries)
    c, evicted = cache.place(PROMPT + (4,), salt="a")
    assert evicted == [a] and cache.match(PROMPT, salt="a") == (c, len(PROMPT))
    assert cache.match(PROMPT, salt="b") == (b, len(PROMPT))


def test_only_an_exact_prompt_of_the_same_salt_with_its_logits_is_a_repeat():
    cache = PrefixCache([1, 2, 3], max_tokens=1000)
    logits = [0.5, 1.5]
    seq_id, _ = cache.place(PROMPT, salt="a", last_logits=logits)
    cache.place(PROMPT[:20], salt="a")  # a prompt cut short (a preempted prefill) keeps no logits
    assert cache.repeat(PROMPT, salt="a").seq_id == seq_id and cache.repeat(list(PROMPT), "a").last_logits is logits
    assert cache.repeat(PROMPT, salt="b") is None and cache.repeat(PROMPT[:20], salt="a") is None
    assert cache.repeat(PROMPT + (1,), salt="a") is None and cache.repeat(PROMPT[:-1], salt="a") is None
    again, evicted = cache.place(PROMPT, salt="a", last_logits=logits)  # replaces its own entry (and the cut one)
    assert seq_id in evicted and cache.repeat(PROMPT, salt="a").seq_id == again


def test_an_answer_kept_after_its_prompt_carries_the_prompts_logits():
    """keep_returned places prompt + answer without logits: the prompt's entry goes, its logits stay with the longer
    entry, so the same prompt again is still a whole repeat (its cells are the first ones of the longer entry)."""
    cache = PrefixCache([1, 2, 3], max_tokens=1000)
    logits = [0.5, 1.5]
    cache.place(PROMPT, salt="a", last_logits=logits)
    answer, evicted = cache.place(PROMPT + (7, 8, 9), salt="a")
    assert len(evicted) == 1 and set(cache.entries) == {answer}
    repeat = cache.repeat(PROMPT, salt="a")
    assert repeat is not None and repeat.seq_id == answer and repeat.last_logits is logits
    assert cache.repeat(PROMPT + (7, 8, 9), salt="a") is None  # the answer's own last logits are not known
    assert cache.repeat(PROMPT, salt="b") is None and cache.repeat(PROMPT[:-1], salt="a") is None
    longer, _ = cache.place(PROMPT + (7, 8, 9, 10), salt="a")  # the next turn: still the first prompt's logits
    assert cache.repeat(PROMPT, salt="a").seq_id == longer


def test_the_default_size_keeps_eight_growing_chats_and_a_smaller_one_thrashes():
    """The multi-turn bench's load in one worker (8 conversations x 6 turns, round robin; each turn's prompt and then
    its answer kept, the answer's entry replacing the prompt's): at the default size (contracts.prompt_cache, the
    embedded model at f16 on 24 GiB) every turn from the second finds the whole previous turn; at the earlier 2048
    tokens the sixth does not."""
    from contracts.options import KNOBS
    from contracts.prompt_cache import prompt_cache_entries, prompt_cache_tokens

    def missed(tokens: int) -> int:
        cache = PrefixCache(list(range(1, 1 + prompt_cache_entries(tokens))), tokens)
        chats = [(c * 1000,) + tuple(range(1, 30)) for c in range(8)]  # a 30-token first turn each
        short = 0
        for turn in range(6):
            for c, chat in enumerate(chats):
                prompt = chat + tuple(range(500, 517)) if turn else chat  # 17 tokens: a question and the template
                _, shared = cache.match(prompt)
                short += turn > 0 and shared < len(chat)
                cache.place(prompt)
                chats[c] = prompt + tuple(range(600, 632))  # the answer's 32 tokens come back
                cache.place(chats[c])
        return short

    assert missed(prompt_cache_tokens(KNOBS["prefix_cache_tokens"].default, 24 * 2**30, 23040)) == 0
    assert missed(2048) > 0
