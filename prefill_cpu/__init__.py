"""CPU prefill: llama.cpp workers that prefill prompts and hand their quantized KV to the decode engine.

Only `prefill_cpu.prefiller` imports llama_cpp; `handoff`, `kv_state` and `gguf_identity` are pure Python
so the decode side can import the wire contract without pulling in llama.cpp.
"""
