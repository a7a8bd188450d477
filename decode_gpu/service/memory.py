"""Where the engine process's memory goes, by component, for the stats it sends (and /health shows), and the
decisions it takes while serving, read from their owners' public state.

The tensors are counted by their bytes: the weights by the precision they are held in (decode_gpu.model.weight_quant
`weights_by_precision`), the KV pool, the swap space of preempted sequences, the rotary tables and step inputs. The
libraries are the RSS measured before the model loaded; `other` is what is left of the RSS: the tokenizer, the
grammar tables, a step's activations, and what the allocator keeps (docs/decode.md, "Memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import psutil
import torch

from contracts.events import EngineDecisions, EngineMemory
from decode_gpu.model.weight_quant import held_weight_dtype, weights_by_precision
from decode_gpu.runner.device import resident_bytes
from decode_gpu.runner.weight_switch import key_name

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def tensors_bytes(tensors) -> int:
    """Bytes of distinct tensors (a view of another counts once, by its storage)."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.is_mkldnn:  # no storage to point at
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        else:
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += size
    return total


class MemoryAccount:
    """The engine's memory by component. What is fixed after start (weights, pool, buffers) is counted once; the
    RSS and the swap space at each `memory()`."""

    def __init__(self, engine, libraries: int = 0) -> None:
        """libraries: the RSS before the model loaded (0: unknown, counted in `other`)."""
        runner = engine.runner
        self.runner = runner
        self.libraries = libraries
        model = getattr(runner, "model", None)
        self.weights = weights_by_precision(model) if model is not None else {}
        pool = getattr(runner, "pool", None)
        self.pool_tensors = _pool_tensors(pool) if pool is not None else []
        self.kv_pool = tensors_bytes(self.pool_tensors)
        self.buffers = tensors_bytes(_buffer_tensors(runner))
        self.device = str(getattr(runner, "device", "cpu"))

    def memory(self) -> EngineMemory:
        rss = rss_bytes()
        swap = sum(tensors_bytes(blocks) for blocks in list(getattr(self.runner, "swap_space", {}).values()))
        on_cpu = self.device == "cpu"
        pool = resident_bytes(self.pool_tensors) if on_cpu else self.kv_pool
        resident = self.libraries + swap  # swap space is host memory wherever the pool lives
        if on_cpu:
            resident += sum(self.weights.values()) + pool + self.buffers
        return EngineMemory(rss=rss, libraries=self.libraries, weights=dict(self.weights), kv_pool=self.kv_pool,
                            kv_pool_resident=pool, swap=swap, buffers=self.buffers, device=self.device,
                            other=rss - resident)


def _pool_tensors(pool) -> list:
    """(A test's fake pool may hold none.)"""
    return [t for name in ("k", "v", "k_scale", "v_scale") for t in getattr(pool, name, None) or []]


def _buffer_tensors(runner) -> list:
    """The rotary tables of the native forward and the step inputs' persistent tensors."""
    native = getattr(runner, "native", None)
    tensors = [*native.cos, *native.sin] if native is not None else []
    inputs = getattr(runner, "inputs", None)
    if inputs is not None:
        tensors += [t for t in vars(inputs).values() if isinstance(t, torch.Tensor)]
    return tensors


def decisions(engine) -> EngineDecisions:
    """The weight plan and speculation as they stand, from their owners' public state (nothing is changed)."""
    runner = engine.runner
    model = getattr(runner, "model", None)
    switch = getattr(runner, "weight_switch", None)
    speculator = engine.speculator
    costs = speculator.costs
    if not engine.config.speculative.enabled:
        speculation = "off"
    elif not speculator.enabled:
        speculation = "paused"
    else:
        speculation = "drafting" if speculator.drafting else "not drafting"
    return EngineDecisions(
        weights=held_weight_dtype(model) if model is not None else "",
        float_above=switch.float_above if switch is not None else -1,
        weight_moved=switch.moved() if switch is not None else {},
        weight_step_ms={key_name(key): round(ms, 2) for key, ms in _estimates(switch)},
        speculation=speculation,
        spec_plain_level=round(costs.plain_level, 3) if costs is not None else 0.0,
        spec_verify_level=round(costs.verify_level or 0.0, 3) if costs is not None else 0.0,
        spec_steps_since_verify=speculator.steps_since_verify)


def _estimates(switch) -> list:
    if switch is None:
        return []
    return sorted(switch.times.ms.items())


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim_heap() -> int:
    """Give the heap's free pages back to the system (glibc's malloc_trim): what loading and quantizing freed stays
    resident otherwise. The bytes of RSS it gave back (0 without glibc)."""
    libc = _libc()
    if libc is None:
        return 0
    before = rss_bytes()
    libc.malloc_trim(0)
    return max(0, before - rss_bytes())
