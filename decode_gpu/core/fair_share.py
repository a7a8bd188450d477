"""Fair decode slots (pure Python, no torch): how many of each request's choices decode in a step.

A request with n choices forks n sequences; if they could take the whole batch, a plain request arriving after a
request with n = 32 waited for every one of its choices to end (19.7 s for an 8-token answer beside four such
requests, issue 47). The batch is shared instead: between priorities strictly (the better level takes what it
needs first), within one priority by water-filling: each request decodes as many of its choices as fit under a
common level, the slots the level leaves over go one each to requests in rank order. A request's choices beyond its
share sit the step out and keep their KV blocks (paused, not failed); they take the slots back as others end.

Where a step's cost grows with its rows (decode on a CPU), a share of the slots is not yet a share of the time: the
request with the most choices also decodes no more rows than keep the step within a bound over the step the others
alone would take (step_budget, SchedulerConfig.share_step_factor), so a plain request beside one with n = 32 gets
its tokens at most that much slower than alone, while the big request keeps the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from decode_gpu.core.sequence import Sequence


@dataclass
class Group:
    """One request's choices in the batch: its rank (its best choice's) and how many want to decode."""
    request_id: str
    rank: tuple[int, float, int]
    num_choices: int

    @property
    def priority(self) -> int:
        return self.rank[0]


def groups_of(seqs: Iterable[Sequence]) -> list[Group]:
    """The requests of these sequences, in rank order."""
    found: dict[str, Group] = {}
    for seq in seqs:
        group = found.get(seq.request_id)
        if group is None:
            found[seq.request_id] = Group(seq.request_id, seq.rank, 1)
        else:
            group.rank, group.num_choices = min(group.rank, seq.rank), group.num_choices + 1
    return sorted(found.values(), key=lambda g: g.rank)


def allot(groups: list[Group], limit: int) -> dict[str, int]:
    """Slots per request id (groups in rank order), at most `limit` in all."""
    out: dict[str, int] = {}
    left = limit
    for priority in sorted({g.priority for g in groups}):
        level = [g for g in groups if g.priority == priority]
        given = water_fill([g.num_choices for g in level], left)
        out.update((g.request_id, n) for g, n in zip(level, given))
        left -= sum(given)
    return out


def water_fill(wants: list[int], capacity: int) -> list[int]:
    """Each gets min(want, level) for the highest level whose total fits; what is left goes one each, in order, to
    those that want more."""
    if sum(wants) <= capacity:
        return list(wants)
    low, high = 0, max(wants)
    while low < high:  # the highest level that fits
        mid = (low + high + 1) // 2
        if sum(min(w, mid) for w in wants) <= capacity:
            low = mid
        else:
            high = mid - 1
    given = [min(w, low) for w in wants]
    left = capacity - sum(given)
    for i, want in enumerate(wants):
        if left and want > given[i]:
            given[i] += 1
            left -= 1
    return given


def gains_slot(running: Iterable[Sequence], waiter: Sequence, limit: int) -> bool:
    """Whether admitting the waiter (with its forks) gives its request more decoding slots than it has without it."""
    running = list(running)
    joined = [waiter, *waiter.forks]
    before = allot(groups_of(running), limit).get(waiter.request_id, 0)
    return allot(groups_of(running + joined), limit).get(waiter.request_id, 0) > before


def step_budget(groups: list[Group], limit: int, rows_within: Callable[[int], int | None] | None) -> int:
    """The batch this step may take: `limit`, and while the request with the most choices shares the batch with
    requests at least as important, no more rows than keep the step within what rows_within allows over the others'
    batch (their choices plus one of its own): its extra choices may slow the others' steps only so much. On a CPU a
    step's cost grows with its rows (a plain request's 8 tokens took 0.73 s beside one n = 32 request at 32 rows,
    against 0.15 s alone); on a GPU it barely does, and the bound is the limit."""
    if rows_within is None or len(groups) < 2:
        return limit
    largest = max(groups, key=lambda g: (g.num_choices, g.rank))
    base = 1 + sum(g.num_choices for g in groups if g is not largest and g.priority <= largest.priority)
    if base == 1 or base >= limit or largest.num_choices == 1:
        return limit
    within = rows_within(base)
    return limit if within is None else max(base, min(limit, within))


def choose(running: list[Sequence], limit: int,
           rows_within: Callable[[int], int | None] | None = None) -> list[Sequence]:
    """The sequences that decode this step (in rank order): each request's best-ranked choices up to its share of
    the step's budget (step_budget). With no more than that running, all of them."""
    groups = groups_of(running)
    budget = step_budget(groups, limit, rows_within)
    if len(running) <= budget:
        return sorted(running, key=lambda s: s.rank)
    shares = allot(groups, budget)
    chosen = []
    for seq in sorted(running, key=lambda s: s.rank):
        if shares.get(seq.request_id, 0) > 0:
            shares[seq.request_id] -= 1
            chosen.append(seq)
    return chosen
