"""What crosses a process boundary, in one package every process imports and that imports none of them.

- `framing`: frames on the control sockets, the authenticated handshake, addresses.
- `messages`: the control frames themselves (gateway <-> prefill worker <-> decode engine).
- `handoff`: the versioned KV handoff and `SamplingParams`.
- `events`: token events and engine stats (engine -> gateway), finish reasons.
- `identity`, `kv_dtypes`: what both sides must agree on about a GGUF and its KV storage types.
- `grammar`, `grammar_compile`: structured-output constraints and their grammars, and where their compiles run.
- `options`: every setting's allowed values, defined once; `process_config`: the typed config the launcher hands
  each child process.
- `reconnect`: the one reconnect loop of the three control links.
- `cpu_share`: the file through which a CPU decode engine and local prefill workers split the cores.
- `cache`: where what is built once is kept (converted weights, weight copies, the benchmark's llama-server).
- `tasks`: fire-and-forget tasks whose exceptions are logged, never lost.

Layering: edge on top; decode_gpu and prefill_cpu side by side, neither importing the other; sampling just above
contracts (it imports only contracts), under both; contracts and policies at the bottom.
"""

# Bumped whenever a frame's fields change; checked at the handshake, so a skewed peer is refused by name.
PROTOCOL_VERSION = 12  # 3: SamplingParams output controls (penalties, logit_bias, min_p, min_tokens, ignore_eos);
# 4: n choices (SamplingParams.n, TokenEvent.index/choice_finish,
# EngineStats.weight_dtype/weight_bytes); 5: the handoff's sliding-window layers (KVLayout.swa_layers/swa_start)
# 6: PrefillJob.engine (the gateway chooses the decode engine per request)
# 7: speculative decoding counters in EngineStats (num_spec_drafts/num_spec_draft_tokens/num_spec_accepted_tokens,
# spec_accepted_per_pos)
# 8: Speculate (gateway -> engine: a policy tier turns speculative decoding off)
# 9: recompute preemption (Recompute, PrefillJob.resume_index, PrefillDone.resumed)
# 10: PrefillJob.cache_salt (prompt caches per tenant)
# 11: tools rendered by the chat template, embeddings, prompt logprobs, tokenize, deadlines
# 12: ReturnedKV (engine -> prefill worker: a finished answer's KV for the next turn's prefix)
