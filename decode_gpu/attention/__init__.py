"""Paged attention: the torch path (CPU, and the kernels' test oracle), the Triton kernels and the KV store."""
