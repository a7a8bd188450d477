"""GPU decode engine: imports prefilled KV handoffs and generates tokens with torch + transformers.

Runs on CUDA when present, else on the CPU with the same code.
"""
