"""Acceptance harnesses that tests and Makefile targets run: the chaos soak and the GPU check."""
