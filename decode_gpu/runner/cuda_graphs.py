"""CUDA graphs of the decode forward, one per batch-size bucket.

A small model on a big GPU is bound by the host: a 16-layer forward launches hundreds of kernels, each
costing microseconds of Python and driver time. A graph replays all of them with one launch. Each bucket's
graph reads the step inputs' fixed device buffers (step_inputs.StepInputs) and writes its logits to a fixed
output; a batch runs in the smallest bucket that holds it, its extra rows padded into the scratch block.

Graphs are captured once, after warm-up (Triton compiles on first launch), largest bucket first, all in one
memory pool. What a graph cannot do: Python code inside the forward does not run on replay, so forward hooks
(the priority gate's between-layer wait) are replaced by a wait between steps; and the KV splits of the
attention kernel are fixed per bucket, sized for the longest context the engine allows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to the first that holds max_num_seqs (vLLM's choice)."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return small + list(range(8, max_num_seqs + 8, 8)) if max_num_seqs > 4 else small + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, buckets: list[int], forward: Callable[[int], torch.Tensor],
                 pad: Callable[[int], None]) -> None:
        """forward(rows): the eager forward over the first `rows` rows of the step inputs, returning logits
        [rows, vocab] (captured as is); pad(rows): fill those rows with padding, so warm-up and capture
        write only the scratch block."""
        self.buckets = sorted(buckets)
        self._forward = forward
        self._pad = pad
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        started = time.perf_counter()
        pool = None
        for rows in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory
            self._pad(rows)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks before a capture
                for _ in range(2):
                    self._forward(rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(rows)
            pool = graph.pool()
            self._graphs[rows] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs of the decode step for batch sizes %s in %.1f s (--enforce-eager turns "
                 "them off)", ",".join(map(str, self.buckets)), time.perf_counter() - started)

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds n rows, or None (then the step runs eagerly)."""
        return next((rows for rows in self.buckets if rows >= n and rows in self._graphs), None)

    def replay(self, rows: int) -> torch.Tensor:
        """Run the bucket's graph on what the step inputs hold now. # [rows, vocab] float32 (a fixed tensor:
        read it before the next replay)"""
        graph, logits = self._graphs[rows]
        graph.replay()
        return logits
