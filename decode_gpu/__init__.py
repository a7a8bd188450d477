"""GPU decode engine: imports prefilled KV handoffs and generates tokens with torch + transformers.

Runs on CUDA when present (Triton paged attention, CUDA graphs), else on the CPU (torch paged attention). The
engine (`engine.py`) and its parts by concern: `service/` (the process), `core/` (bookkeeping, no torch), `runner/`
(the only owner of device tensors), `attention/`, `kv/`, `sample/`, `model/`, `reference/` (docs/decode.md).
"""
