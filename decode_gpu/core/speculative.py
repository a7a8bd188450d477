"""N-gram (prompt lookup) speculative decoding: draft proposals, a cost model of the step, counters (no torch).

A sequence's draft is what followed the most recent earlier occurrence of its last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`), in its prompt or its output so far: no draft model. The engine
feeds the newest token and the draft through one multi-token forward and samples every position with its own
sampling pipeline (the same seeded draw a non-speculative step would make there); a draft token is accepted
while it equals that draw. With a one-hot draft this is speculative rejection sampling: the draft token d is
accepted with probability p(d), and on rejection the draw is distributed as p without d, renormalized. Because
the draw is the one the plain step makes, the output equals the non-speculative output token for token, greedy
or seeded (given the same logits: a forward of another shape may round differently).

Speculation costs compute, and how much depends on the device and the weights: on a GPU a forward of a few more
rows costs almost nothing; on a CPU with int8 weights each row costs nearly as much as the first. So the step is
planned against a cost model (StepCosts: a forward's milliseconds by the rows it feeds), measured by a short probe
at start-up (or reused from a quiet start) and then corrected by the steps as they run (LiveCosts: a moving estimate
of observed against modelled time from the plain steps, which verify steps follow, times verify's own ratio to it).
A plan that drafts must beat the plain step by `margin` to start drafting and by `keep_margin` to go on
(hysteresis); when no verify step has run for
`probe_steps` steps while drafts were proposed, one sequence's draft is verified anyway, so that a cost model taken
in a noisy second cannot keep speculation off for the day.
Each sequence estimates the chance that its next draft token is accepted (from its recent drafts, decayed); the
planner takes draft tokens in order of their expected worth (the chance that they and the ones before them are
accepted) as long as expected tokens per millisecond rise, and drafts nothing when the plain step makes more. A
sequence whose drafts keep failing is left out; its estimate drifts back towards the optimistic prior while it
does not draft, so it probes again later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from decode_gpu.core.block_manager import BlockCopy, BlockManager
from decode_gpu.core.sequence import SeqState, Sequence

log = logging.getLogger(__name__)
METHODS = ("off", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # off | ngram (--speculative)
    num_speculative_tokens: int = 4  # K: draft tokens verified per step at most (--num-speculative-tokens)
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # the shortest: one-token matches are mostly chance in prose
    decay: float = 0.7  # a sequence's acceptance is estimated from recent drafts, older ones weighing less by this
    # factor, starting from one optimistic pseudo-trial (accepted); while it does not draft, its estimate moves back
    # towards that by this factor a step, so that it is tried again
    recovery: float = 0.9
    # a plan with drafts must promise this much more tokens per ms than the plain step: acceptance estimates run
    # optimistic (a copy ends without warning), and a plan that only breaks even costs the same and risks more.
    # 0.3 against 0.15 on the embedded model (2026-12-02, two rounds): code edit 1.82-1.84x against 1.68-1.71x at
    # batch 1 and 1.41-1.50x against 1.39-1.44x at batch 4, non-repetitive text no worse (docs/decode.md)
    margin: float = 0.3
    planned: bool = True  # plan drafts against the measured StepCosts; False: every proposal is drafted in full
    keep_margin: float = 0.1  # while drafting, a plan need beat the plain step by only this much (hysteresis)
    probe_steps: int = 64  # steps without a verify (while drafts were proposed) before one is verified anyway

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

    def max_rows(self, max_num_seqs: int) -> int:
        """The most rows one step may feed: every sequence its newest token and K draft tokens."""
        return max_num_seqs * (1 + self.num_speculative_tokens if self.enabled else 1)


@dataclass(frozen=True)
class StepCosts:
    """What a forward costs, in ms, by the rows it feeds: `plain` for one token per sequence (the static step, a
    CUDA graph's replay where there are graphs), `verify` for the ragged multi-token step, measured with `width`
    rows per sequence (the last one fewer). Each is (rows, ms) points, ascending; linear between them, and past the
    last along the last segment's slope. A verify step of more sequences for the same rows costs `seq_ms` more
    for each (their own attention and metadata)."""
    plain: tuple[tuple[int, float], ...]
    verify: tuple[tuple[int, float], ...]
    width: int = 1
    seq_ms: float = 0.0

    def plain_ms(self, rows: int) -> float:
        return _interpolate(self.plain, rows)

    def verify_ms(self, rows: int, seqs: int) -> float:
        return _interpolate(self.verify, rows) + self.seq_ms * max(0, seqs - -(-rows // self.width))

    def to_json(self) -> str:
        return json.dumps({"plain": self.plain, "verify": self.verify, "width": self.width, "seq_ms": self.seq_ms})

    @classmethod
    def from_json(cls, text: str) -> StepCosts:
        data = json.loads(text)
        points = lambda key: tuple((int(r), float(ms)) for r, ms in data[key])  # noqa: E731
        return cls(points("plain"), points("verify"), int(data["width"]), float(data["seq_ms"]))

    def describe(self) -> str:
        return "; ".join(f"{name} " + " ".join(f"{rows}:{ms:.1f}" for rows, ms in points)
                         for name, points in (("plain", self.plain), ("verify", self.verify))) + \
            f"; {self.seq_ms:.2f} a sequence more"


class LiveCosts:
    """StepCosts corrected by what real steps take: the start-up curves' shape, times a level that follows observed /
    modelled ms of plain steps as a moving estimate (each step weighs `weight`; one observation is clamped to
    1/8..8x, so a stall does not swing it), and for verify steps that level times a ratio, the moving estimate of how
    far verify steps stand off it. Load (a neighbour busy at start-up, or now) moves both kinds alike, so the plain
    steps, which run all the time, carry it to verify at once; the ratio, learnt from the rarer verify steps, keeps
    what the probe misjudged between the two (1 until one is observed)."""

    def __init__(self, prior: StepCosts, weight: float = 0.2) -> None:
        self.prior = prior
        self.weight = weight
        self.plain_level = 1.0
        self.verify_ratio = 1.0
        self.observed = {"plain": 0, "verify": 0}

    @property
    def verify_level(self) -> float | None:
        """Observed over modelled verify ms as it stands (None until a verify step is observed)."""
        return self.plain_level * self.verify_ratio if self.observed["verify"] else None

    def plain_ms(self, rows: int) -> float:
        return self.prior.plain_ms(rows) * self.plain_level

    def verify_ms(self, rows: int, seqs: int) -> float:
        return self.prior.verify_ms(rows, seqs) * self.plain_level * self.verify_ratio

    def observe(self, kind: str, rows: int, seqs: int, ms: float) -> None:
        """A real step of `kind` ("plain" or "verify") fed `rows` rows of `seqs` sequences and took `ms`."""
        modelled = self.prior.plain_ms(rows) if kind == "plain" else self.prior.verify_ms(rows, seqs)
        if modelled <= 0 or ms <= 0:
            return
        ratio = min(8.0, max(0.125, ms / modelled))
        self.observed[kind] += 1
        if kind == "plain":
            self.plain_level += self.weight * (ratio - self.plain_level)
        else:
            self.verify_ratio += self.weight * (min(8.0, max(0.125, ratio / self.plain_level)) - self.verify_ratio)

    def describe(self) -> str:
        verify = f"{self.verify_level:.2f}" if self.verify_level is not None else "as plain"
        return (f"levels against the start-up model: plain {self.plain_level:.2f} ({self.observed['plain']} steps), "
                f"verify {verify} ({self.observed['verify']} steps)")


def _interpolate(points: tuple[tuple[int, float], ...], rows: int) -> float:
    if len(points) == 1:
        return points[0][1]
    i = next((i for i in range(1, len(points)) if rows <= points[i][0]), len(points) - 1)
    (r0, t0), (r1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


def measurement_rows(limit: int, cap: int = 64) -> list[int]:
    """Where a cost curve is measured: every count up to 6 (the int8/float switch of the CPU's weights lies
    there), then about 1.5x apart, up to `limit` or `cap` (past it, extrapolated)."""
    top, rows, r = min(limit, cap), [], 1
    while r < top:
        rows.append(r)
        r = r + 1 if r < 6 else int(r * 1.5)
    if rows and top - rows[-1] < rows[-1] // 4:
        rows.pop()  # too close to the top to tell apart
    return rows + [top]


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
    """One sequence's proposer and its acceptance estimate."""
    index: NgramIndex
    accepted: float = 1.0  # draft tokens accepted, and tried (up to and including the first rejected one), in
    tried: float = 1.0  # recent drafts, older ones decayed; one optimistic pseudo-trial to start from

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is accepted, given that the ones before it were."""
        return self.accepted / self.tried

    def record(self, num_drafted: int, num_accepted: int, config: SpecConfig) -> None:
        self.accepted = config.decay * self.accepted + num_accepted
        self.tried = config.decay * self.tried + num_accepted + (num_accepted < num_drafted)

    def rest(self, config: SpecConfig) -> None:
        """A step without a draft: the estimate moves back towards the optimistic start (one pseudo-trial,
        accepted)."""
        self.accepted = config.recovery * self.accepted + (1 - config.recovery)
        self.tried = config.recovery * self.tried + (1 - config.recovery)


def plan_drafts(proposals: list[list[int]], acceptance: list[float], costs: StepCosts | LiveCosts | None,
                margin: float = 0.0) -> list[int]:
    """How many tokens of each proposal to verify this step, for the most expected tokens per ms.

    A draft token's expected worth is the chance that it and every one before it are accepted (acceptance ** j
    for the j-th). Tokens are taken best first, which keeps each sequence's a prefix of its proposal, and the
    step takes the count that maximizes (batch + expected accepted) / verify_ms(batch + count, batch); it drafts nothing
    unless that beats batch / plain_ms(batch) by `margin`. Without costs, everything is drafted."""
    if costs is None:
        return list(map(len, proposals))
    batch = len(proposals)
    worth = sorted((-(a ** j), i, j) for i, (proposal, a) in enumerate(zip(proposals, acceptance))
                   for j in range(1, len(proposal) + 1))
    best, best_rate, expected = 0, (1 + margin) * batch / costs.plain_ms(batch), float(batch)
    for n, (neg_worth, _, _) in enumerate(worth, 1):
        expected -= neg_worth
        rate = expected / costs.verify_ms(batch + n, batch)
        if rate > best_rate:
            best, best_rate = n, rate
    lengths = [0] * batch
    for _, i, _ in worth[:best]:
        lengths[i] += 1
    return lengths


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

    def __init__(self, config: SpecConfig, costs: StepCosts | None = None) -> None:
        self.config = config
        self.costs = LiveCosts(costs) if config.planned and costs is not None else None
        self.enabled = config.enabled  # a policy may turn speculation off under load, and on again
        self.counters = SpecCounters()
        self.drafting = False  # whether the last step drafted (the hysteresis' state)
        self.steps_since_verify = 0  # steps with proposals but no verify

    def observe(self, verified: bool, rows: int, seqs: int, ms: float) -> None:
        """A real step's time (forward and sampling), for the live cost model."""
        if self.costs is not None:
            self.costs.observe("verify" if verified else "plain", rows, seqs, ms)

    def plan(self, seqs: list[Sequence], blocks: BlockManager, max_model_len: int,
             copies: list[BlockCopy]) -> dict[str, list[int]]:
        """Each sequence's draft (seq id -> tokens), KV slots for its positions reserved; a copy-on-write that
        a reservation needs goes to `copies`. A draft takes a block only while every one of seqs could still
        grow by one afterwards: drafts never cause a preemption. A sequence's length grows only by what is
        accepted; reserved blocks it has not filled stay in its table, and it grows into them (or frees them
        at its end)."""
        if not self.enabled:
            return {}
        proposals = [self._proposal(seq, max_model_len) for seq in seqs]
        lengths = self.lengths(proposals, [self._state(seq).acceptance for seq in seqs])
        drafts = {}
        for seq, proposal, k in zip(seqs, proposals, lengths):
            if k and self._reserve(seq, k, blocks, len(seqs), copies):
                drafts[seq.seq_id] = proposal[:k]
            elif seq.state is SeqState.RUNNING:
                self._state(seq).rest(self.config)
        return drafts

    def lengths(self, proposals: list[list[int]], acceptance: list[float]) -> list[int]:
        """How many tokens of each proposal to verify: plan_drafts with the margin of the state (start or keep
        drafting), or one sequence's whole proposal when no verify step has run for probe_steps steps."""
        margin = self.config.keep_margin if self.drafting else self.config.margin
        lengths = plan_drafts(proposals, acceptance, self.costs, margin)
        if any(proposals) and not any(lengths):
            self.steps_since_verify += 1
            if self.steps_since_verify >= self.config.probe_steps:  # verify the likeliest draft: the costs may be stale
                best = max((i for i, p in enumerate(proposals) if p), key=acceptance.__getitem__)
                lengths[best] = len(proposals[best])
        if any(lengths):
            self.steps_since_verify = 0
        if any(lengths) != self.drafting and self.costs is not None:
            log.info("speculative decoding %s drafting (%s)", "starts" if any(lengths) else "stops",
                     self.costs.describe())
        self.drafting = any(lengths)
        return lengths

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.counters.record(num_drafted, num_accepted)
        self._state(seq).record(num_drafted, num_accepted, self.config)

    def _state(self, seq: Sequence) -> DraftState:
        if "draft" not in seq.meta:
            seq.meta["draft"] = DraftState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        return seq.meta["draft"]

    def _proposal(self, seq: Sequence, max_model_len: int) -> list[int]:
        """Up to K tokens; none for structured outputs (the grammar matcher would have to take drafts and roll
        them back)."""
        if seq.state is not SeqState.RUNNING or seq.meta.get("matcher") is not None:
            return []
        # a step makes up to 1 + K tokens and feeds positions up to len(tokens) - 1 + K: within max_tokens and
        # max_model_len
        limit = min(seq.sampling.max_tokens - len(seq.output_tokens) - 1, max_model_len - len(seq.tokens),
                    self.config.num_speculative_tokens)
        return self._state(seq).index.propose(seq.tokens, limit) if limit > 0 else []

    @staticmethod
    def _reserve(seq: Sequence, num_draft: int, blocks: BlockManager, spare: int, copies: list[BlockCopy]) -> bool:
        need = seq.num_cached + 1 + num_draft  # positions, the draft's included
        extra = blocks.blocks_for(need) - len(blocks.block_tables[seq.seq_id])
        if extra > 0 and blocks.num_free_blocks - extra < spare or not blocks.can_append(seq.seq_id, need):
            return False
        if copy := blocks.append(seq.seq_id, need):
            copies.append(copy)
        return True
