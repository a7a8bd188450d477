"""Acceptance harnesses that tests and Makefile targets run (the chaos soak, the GPU check), and what tests and
bench/ share: llama.cpp's own llama-server built from the pinned source, the shared-prefix workload."""
