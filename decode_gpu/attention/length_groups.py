"""Length groups for the CPU's torch path: a batch's sequences split by context length so that each group is
padded only to its own longest context."""

from __future__ import annotations

# What attending to one group of rows more costs, in tokens of context gathered and attended (a gather of K and V,
# an SDPA, a copy in and out: about 40 us a layer, as much as about 450 tokens, bfloat16 on 2 cores of a Xeon)
GROUP_COST_TOKENS = 512
MAX_GROUPS = 4


def length_groups(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Sequences split into groups of similar context length (at most MAX_GROUPS), each to be padded only to its own
    longest context on the CPU's torch path: the split that gathers the fewest tokens, counting GROUP_COST_TOKENS a
    group. Without it a batch of short contexts and one long one gathers and attends the long one's length for
    every sequence."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    blocks = [-(-context_lens[i] // block_size) * block_size for i in order]  # padded lengths, ascending
    n = len(order)
    if n * blocks[-1] - sum(blocks) <= GROUP_COST_TOKENS:  # padding to the longest costs less than a group more
        return [order]
    # best[g][i]: (cost, start of the last group) of the first i sequences in g groups
    best = [[(0, 0)] + [(float("inf"), 0)] * n]
    for _ in range(MAX_GROUPS):
        prev, row = best[-1], [(0, 0)] + [(float("inf"), 0)] * n
        for i in range(1, n + 1):
            row[i] = min((prev[j][0] + (i - j) * blocks[i - 1] + GROUP_COST_TOKENS, j) for j in range(i))
        best.append(row)
    groups_used = min(range(1, MAX_GROUPS + 1), key=lambda g: best[g][n][0])
    groups, end = [], n
    for g in range(groups_used, 0, -1):
        start = best[g][end][1]
        groups.append([order[i] for i in range(start, end)])
        end = start
    return [group for group in groups[::-1] if group]  # an empty group is never cheaper, but never return one
