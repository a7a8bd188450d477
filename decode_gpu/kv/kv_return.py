"""A finished sequence's KV on its way back to a prefill worker, off the engine thread's hot path.

The engine thread only copies the sequence's blocks out of the pool at the end of the step it finished in (before
any later step can write the freed blocks) and offers them here; one low-priority thread encodes them
(decode_gpu.kv.exporter: the handoff's own KV type) into a KVHandoff and passes its bytes to `deliver`, which the
engine service runs on its loop (it sends them to the worker that prefilled the request). Bounded in bytes: an offer
past `max_bytes` of copies waiting is dropped and counted, never queued.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from contracts.handoff import KVHandoff, KVLayout, encode_handoff
from decode_gpu.kv.exporter import export_layers
from decode_gpu.kv.pool import PoolShape

log = logging.getLogger(__name__)
DEFAULT_RETURN_BYTES = 64 << 20  # copies of finished sequences' blocks waiting to be encoded, at most
MIN_RETURN_TOKENS = 16  # shorter sequences are not worth a prefix entry (the worker's disk tier's block, too)


@dataclass
class FinishedKV:
    """A finished sequence's blocks, copied to host memory by the engine thread."""
    request_id: str
    fingerprint: str
    layout: KVLayout  # the handoff's: the KV type and rotations the worker's context uses
    tokens: tuple[int, ...]  # those whose KV the blocks hold (positions 0..n-1)
    next_token: int  # the last token sampled (no KV: it was never fed)
    cache_salt: str
    saved: list[torch.Tensor]  # KVPool.read_blocks' tensors
    shape: PoolShape
    ready: object = None  # a CUDA event the copies finish at (None on the CPU)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved)


class KVReturn:
    def __init__(self, deliver: Callable[[str, bytes], None], max_bytes: int = DEFAULT_RETURN_BYTES) -> None:
        """deliver(request_id, encoded handoff): called on this object's thread; it must hand over to its own."""
        self.deliver = deliver
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self.num_returned = self.num_dropped = self.returned_bytes = 0
        self._queue: queue.Queue[FinishedKV | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-return", daemon=True)
        self._thread.start()

    def can_offer(self, nbytes: int) -> bool:
        with self._lock:
            return self._queued_bytes + nbytes <= self.max_bytes

    def offer(self, item: FinishedKV) -> bool:
        """Queue a copy (engine thread); False (dropped, counted) when it would pass the byte limit."""
        with self._lock:
            if self._queued_bytes + item.nbytes > self.max_bytes:
                self.num_dropped += 1
                return False
            self._queued_bytes += item.nbytes
        self._queue.put(item)
        return True

    def count_dropped(self) -> None:
        with self._lock:
            self.num_dropped += 1

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # the decode step goes first
        except (OSError, AttributeError):
            pass
        while (item := self._queue.get()) is not None:
            try:
                data = encode(item)
                self.deliver(item.request_id, data)
                with self._lock:
                    self.num_returned += 1
                    self.returned_bytes += len(data)
            except Exception:  # one bad sequence must not end the thread
                log.exception("returning the KV of %s failed", item.request_id)
                self.count_dropped()
            finally:
                with self._lock:
                    self._queued_bytes -= item.nbytes
                self._queue.task_done()
        self._queue.task_done()


def encode(item: FinishedKV) -> bytes:
    """The copy as an encoded KVHandoff in the handoff's own KV type."""
    if item.ready is not None:
        item.ready.synchronize()  # the non-blocking device-to-host copies are done
    n = len(item.tokens)
    k_layers, v_layers = export_layers(item.saved, item.shape, n, item.layout)
    handoff = KVHandoff(request_id=item.request_id, model_fingerprint=item.fingerprint, layout=item.layout,
                        positions=tuple(range(n)), prompt_tokens=item.tokens, first_token=item.next_token,
                        k_layers=k_layers, v_layers=v_layers, cache_salt=item.cache_salt)
    return encode_handoff(handoff)


def copy_out(pool, blocks: list[int]) -> tuple[list[torch.Tensor], object]:
    """Engine thread: the blocks' tensors copied to host memory, and the CUDA event those copies end at."""
    saved = pool.read_blocks(blocks)
    ready = None
    if pool.k[0].device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return saved, ready
