"""One sampling semantics for every token of an answer: the prefill worker draws each choice's first token and the
decode engine every later one through the same batched functions (docs/sampling.md, "Where sampling happens").

`sampler` draws a batch of rows (the controls in one order, then the seeded draw), `sampling_params` builds a batch's
per-row parameters and says which tokens min_tokens bans, `seeded_noise` is the counter-based noise keyed by seed and
position, `token_mask` applies a grammar's bitmask. Imports contracts/ only, so both processes can import it.
"""
