"""How many KV tokens the pool gets on a GPU, as vLLM sizes it.

`gpu_memory_utilization` is the fraction of the device's *total* memory this engine may use. From it come
off the weights (what torch holds before the pool), the peak of a profiling forward at the largest batch
(activations, logits, sampling scratch), and what other code holds outside torch's allocator (the CUDA
context, cuBLAS workspaces, another process). The rest is the pool. Sizing by *free* memory instead
would make the pool depend on whatever else happened to be allocated at start, with no room for the peak.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # device memory, bytes
    free: int  # free on the device after the profiling forward
    torch_allocated: int  # held by torch tensors before the profiling forward (the weights)
    torch_reserved: int  # held by torch's caching allocator after the profiling forward
    peak_activation: int  # peak of the profiling forward over what was allocated before it

    @property
    def non_torch(self) -> int:
        """Used on the device but not through torch's allocator (CUDA context, libraries, other processes)."""
        return max(0, self.total - self.free - self.torch_reserved)


def kv_budget_bytes(profile: MemoryProfile, utilization: float, per_token: int) -> int:
    """The pool's bytes; raises with the arithmetic when nothing is left for it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {utilization}")
    allowed = int(profile.total * utilization)
    budget = allowed - profile.torch_allocated - profile.peak_activation - profile.non_torch
    summary = (f"{utilization:.2f} x {profile.total / GIB:.1f} GiB total = {allowed / GIB:.2f} GiB, minus weights "
               f"{profile.torch_allocated / GIB:.2f} GiB, peak activations {profile.peak_activation / GIB:.2f} GiB, "
               f"non-torch {profile.non_torch / GIB:.2f} GiB")
    if budget < per_token:
        raise ValueError(f"no GPU memory left for the KV cache: {summary} = {budget / GIB:.2f} GiB; raise "
                         f"gpu_memory_utilization, or set kv_cache_tokens")
    log.info("KV cache sizing: %s = %.2f GiB for the KV pool (%d tokens)", summary, budget / GIB, budget // per_token)
    return budget
