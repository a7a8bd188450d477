"""CPU prefill: llama.cpp workers that prefill prompts and hand their KV, as llama.cpp stored it, to the decode engine.

The modules that import llama_cpp are `prefiller`, `prompt_renderer`, `prefill_weights` and `llama_log` (and so
`worker`, which uses them); `kv_state`, `prefix_cache`, `engine_link` and `embedded_model` are pure Python. The wire
contract both sides share (the handoff, the GGUF identity, the KV dtypes) lives in `contracts/`, so the decode side
never imports this package.
"""
