"""N-gram (prompt lookup) speculative decoding: draft proposals, per-sequence adaptivity, counters (no torch).

A sequence's draft is what followed the most recent earlier occurrence of its last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`), in its prompt or its output so far: no draft model. The engine
feeds the newest token and the draft through one multi-token forward and samples every position with its own
sampling pipeline (the same seeded draw a non-speculative step would make there); a draft token is accepted
while it equals that draw. With a one-hot draft this is speculative rejection sampling: the draft token d is
accepted with probability p(d), and on rejection the draw is distributed as p without d, renormalized. Because
the draw is the one the plain step makes, the output equals the non-speculative output token for token, greedy
or seeded (given the same logits: a forward of another shape may round differently).

Speculation costs batch compute, so each sequence estimates how likely its draft tokens are to be accepted and
proposes only as many as are likely enough; one whose drafts keep failing stops proposing, and probes again
after a back-off that doubles each time a probe fails.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from decode_gpu.block_manager import BlockCopy, BlockManager
from decode_gpu.sequence import SeqState, Sequence

METHODS = ("off", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # off | ngram (--speculative)
    num_speculative_tokens: int = 4  # K: draft tokens verified per step at most (--num-speculative-tokens)
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # the shortest: one-token matches are mostly chance in prose
    # what verifying one draft token costs, as a share of a plain step at batch 1. A plain step's cost is shared
    # by its batch, a draft token's is not: a draft token is verified only while the chance that it and the ones
    # before it are accepted is at least draft_cost x batch size; below that for a single token, a sequence stops
    # proposing ... On the 2-core CPU with int8 weights one draft token costs 3.3 ms against a 24 ms step at batch
    # 1, but a batch of 4 feeding 8 tokens instead of 4 costs 49 ms instead of 29 (the int8 kernel's cost grows
    # with rows): 0.25 keeps batches of 4 and more from speculating there, past a first try and rare probes
    draft_cost: float = 0.25
    decay: float = 0.7  # ... its acceptance estimated from recent steps, older ones weighing less by this factor
    backoff_steps: int = 8  # ... for this many steps, doubling after each probe that fails
    max_backoff_steps: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class NgramIndex:
    """For each n-gram of the tokens seen so far, where its most recent occurrence is followed. Extended
    incrementally (a step costs O(prompt_lookup_max) dict updates per new token, not a scan of the context)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.follower: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.num_indexed = 0  # tokens[:num_indexed] have their preceding n-grams registered

    def extend(self, tokens: Seq[int]) -> None:
        """Register every n-gram that ends before a token not yet indexed (it now has a follower)."""
        for t in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, t) + 1):
                self.follower[tuple(tokens[t - n:t])] = t
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """k tokens that followed the most recent earlier occurrence of the longest suffix n-gram found. The copy
        may run into its own output (as an LZ77 match does): a text repeating with a period shorter than k
        keeps repeating, where a copy stopping at the end of the tokens would propose only one period."""
        self.extend(tokens)
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            start = self.follower.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                period = len(tokens) - start  # the draft repeats tokens[start:], the copy of its own output included
                return [tokens[start + j % period] for j in range(k)]
        return []


def propose_ngram(tokens: Seq[int], k: int, n_min: int, n_max: int) -> list[int]:
    """One-shot prompt lookup (the engine keeps an NgramIndex per sequence instead)."""
    return NgramIndex(n_min, n_max).propose(tokens, k)


def accepted_length(draft: Seq[int], sampled: Seq[int]) -> int:
    """How many draft tokens the target's own draws confirm: the longest prefix where draft[j] == sampled[j].
    sampled has one more entry than draft (the draw after the last draft token); -1 marks a row that could
    not be sampled, which matches nothing."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


@dataclass
class DraftState:
    """One sequence's proposer and its adaptivity."""
    index: NgramIndex
    accepted: float = 1.0  # draft tokens accepted, and tried (up to and including the first rejected one), in
    tried: float = 1.0  # recent steps, older steps decayed; one optimistic pseudo-trial to start from
    idle_steps: int = 0  # steps left before the next probe while speculation is off for this sequence
    backoff: int = 0  # the length of the last back-off; 0 once a draft is accepted whole

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is accepted, given that the ones before it were."""
        return self.accepted / self.tried

    def draft_length(self, config: SpecConfig, batch: int) -> int:
        """The longest draft (up to K) whose last token is still likely enough to be accepted in a batch of this
        size; 0 while backing off, or when not even one token is (then the sequence backs off)."""
        if self.idle_steps > 0:
            self.idle_steps -= 1
            return 0
        k, reach, bar = 0, self.acceptance, config.draft_cost * batch
        while k < config.num_speculative_tokens and reach >= bar:
            k, reach = k + 1, reach * self.acceptance
        if k == 0:
            self._back_off(config)
        return k

    def record(self, num_drafted: int, num_accepted: int, config: SpecConfig) -> None:
        self.accepted = config.decay * self.accepted + num_accepted
        self.tried = config.decay * self.tried + num_accepted + (num_accepted < num_drafted)
        if num_accepted == num_drafted:
            self.backoff = 0

    def _back_off(self, config: SpecConfig) -> None:
        self.backoff = min(config.max_backoff_steps, 2 * self.backoff or config.backoff_steps)
        self.idle_steps = self.backoff - 1  # this step is the first
        self.accepted = self.tried = 1.0  # the probe after the back-off starts afresh


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters, cumulative over the engine's life."""
    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens by draft position

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class Speculator:
    """The engine's drafts: which sequences propose this step, with how many tokens, and what came of it."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.enabled = config.enabled  # a policy may turn speculation off under load, and on again
        self.counters = SpecCounters()

    def plan(self, seqs: list[Sequence], blocks: BlockManager, max_model_len: int,
             copies: list[BlockCopy]) -> dict[str, list[int]]:
        """Each sequence's draft (seq id -> tokens), KV slots for its positions reserved; a copy-on-write that
        a reservation needs goes to `copies`. A draft takes a block only while every one of seqs could still
        grow by one afterwards: drafts never cause a preemption. A sequence's length grows only by what is
        accepted; reserved blocks it has not filled stay in its table, and it grows into them (or frees them
        at its end)."""
        if not self.enabled:
            return {}
        drafts = {}
        for seq in seqs:
            draft = self._proposal(seq, max_model_len, len(seqs))
            if draft and self._reserve(seq, len(draft), blocks, len(seqs), copies):
                drafts[seq.seq_id] = draft
        return drafts

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.counters.record(num_drafted, num_accepted)
        seq.meta["draft"].record(num_drafted, num_accepted, self.config)

    def _proposal(self, seq: Sequence, max_model_len: int, batch: int) -> list[int]:
        """As many tokens as are likely to be accepted, up to K; none for structured outputs (the grammar matcher
        would have to take drafts and roll them back) or while the sequence backs off."""
        if seq.state is not SeqState.RUNNING or seq.meta.get("matcher") is not None:
            return []
        if "draft" not in seq.meta:
            seq.meta["draft"] = DraftState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        state: DraftState = seq.meta["draft"]
        # a step makes up to 1 + K tokens and feeds positions up to len(tokens) - 1 + K: within max_tokens and
        # max_model_len
        limit = min(seq.sampling.max_tokens - len(seq.output_tokens) - 1, max_model_len - len(seq.tokens))
        if limit <= 0:
            return []
        k = min(limit, state.draft_length(self.config, batch))
        return state.index.propose(seq.tokens, k) if k > 0 else []

    @staticmethod
    def _reserve(seq: Sequence, num_draft: int, blocks: BlockManager, spare: int, copies: list[BlockCopy]) -> bool:
        need = seq.num_cached + 1 + num_draft  # positions, the draft's included
        extra = blocks.blocks_for(need) - len(blocks.block_tables[seq.seq_id])
        if extra > 0 and blocks.num_free_blocks - extra < spare or not blocks.can_append(seq.seq_id, need):
            return False
        if copy := blocks.append(seq.seq_id, need):
            copies.append(copy)
        return True
