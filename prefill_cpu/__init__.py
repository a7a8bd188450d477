"""CPU prefill: llama.cpp workers that prefill prompts and hand their KV, as llama.cpp stored it, to the decode engine.

The modules that import llama_cpp are `prefiller`, `prompt_renderer`, `prefill_weights`, `llama_log` and `grammar`
(the last only when used; it also needs llguidance), and so `worker`, which uses them; `first_token` draws with
the shared `sampling/` package (torch, no llama.cpp); `kv_state`, `kv_rotation`, `prefix_cache`, `engine_link` and
`embedded_model` are pure Python. The gateway imports `embedded_model`, and `grammar` for its structured-output
check (the GGUF's vocabulary only). The wire contract both sides share (the handoff, the GGUF identity, the KV
dtypes) lives in `contracts/`, so the decode side never imports this package.
"""
