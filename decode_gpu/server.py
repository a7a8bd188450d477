"""The decode engine process: loads the model, listens for handoffs and aborts, streams token events.

    python -m decode_gpu.server --model PATH.gguf --listen unix:/tmp/edge/engine.sock [--device auto]

The engine steps in its own thread (torch releases the GIL); an asyncio loop owns the sockets. A handoff's
first token (sampled by the prefill worker) is sent the moment the handoff arrives, on the asyncio side,
not after the step in progress; the sequence then joins the engine between two steps. The engine listens
only after the model is loaded, so a successful connection means the engine is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import logging
import queue
import signal
import threading

from decode_gpu.device import resolve_device, resolve_dtype
from decode_gpu.engine import DecodeEngine, EngineConfig, HandoffRejectedError, TokenEvent
from decode_gpu.model_loader import load_decode_model, load_tokenizer
from decode_gpu.model_runner import ModelRunner, RunnerConfig
from decode_gpu.priority_gate import PriorityGate
from decode_gpu.scheduler import SchedulerConfig
from edge.protocol import (Abort, DecodeYield, Handoff, Hello, Stats, Token, read_message, send_message,
                           start_server)
from prefill_cpu.gguf_identity import read_gguf_identity
from prefill_cpu.handoff import HandoffFormatError, decode_handoff

log = logging.getLogger("decode_gpu.server")
STATS_INTERVAL_S = 0.5


class EngineService:
    def __init__(self, engine: DecodeEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.gate: PriorityGate = engine.runner.gate or PriorityGate(enabled=False)
        self.loop = loop
        self.inbox: queue.Queue = queue.Queue()  # ("admit", Sequence) or ("abort", request id), in arrival order
        self.gateways: set[asyncio.StreamWriter] = set()
        self.pending_events: collections.deque = collections.deque(maxlen=100_000)  # while no gateway is connected
        self.live: set[str] = set()  # opened and not yet ended (asyncio side)
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborts seen before the handoff
        self.stopping = threading.Event()

    # --- engine thread -------------------------------------------------------------------------
    def run_engine(self) -> None:
        while not self.stopping.is_set():
            self._drain_inbox(block=not self.engine.has_work)
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as err:  # a failed step must not leave requests hanging: fail them all
                    log.exception("decode step failed")
                    events = self._fail_all(f"decode step failed: {err}")
                self._publish(events)
        self._drain_inbox(block=False)  # opened sequences still in the inbox end with the rest
        self._publish(self._abort_all())

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            self._publish(self._admit(payload) if kind == "admit" else self._abort(payload))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, seq) -> list[TokenEvent]:
        try:
            self.engine.admit(seq)
            return []
        except HandoffRejectedError as err:
            return [TokenEvent(seq.seq_id, (), "", "error", error=str(err), num_prompt_tokens=seq.prompt_len)]

    def _abort(self, request_id: str) -> list[TokenEvent]:
        event = self.engine.abort(request_id)
        return [] if event is None else [event]  # None: it ended on its own in the meantime

    def _fail_all(self, why: str) -> list[TokenEvent]:
        events = []
        for request_id in list(self.engine.sequences):
            event = self.engine.abort(request_id)
            events.append(dataclasses.replace(event, finish_reason="error", error=why))
        return events

    def _abort_all(self) -> list[TokenEvent]:
        return [self.engine.abort(request_id) for request_id in list(self.engine.sequences)]

    def _publish(self, events: list[TokenEvent]) -> None:
        if events:
            self.loop.call_soon_threadsafe(self._send_events, events)

    # --- asyncio side ------------------------------------------------------------------------
    def _on_handoff(self, data: bytes) -> None:
        try:
            handoff = decode_handoff(data)
        except HandoffFormatError as err:
            log.error("dropped a malformed handoff: %s", err)
            return
        request_id = handoff.request_id
        if request_id in self.aborted:  # the client went away while it was being prefilled
            del self.aborted[request_id]
            self._send_events([TokenEvent(request_id, (), "", "abort", num_prompt_tokens=handoff.n_tokens)])
            return
        try:
            if request_id in self.live:
                raise HandoffRejectedError(f"request id {request_id} is already decoding")
            seq, first = self.engine.open(handoff)
        except HandoffRejectedError as err:
            log.error("handoff %s rejected: %s", request_id, err)
            self._send_events([TokenEvent(request_id, (), "", "error", error=str(err),
                                          num_prompt_tokens=handoff.n_tokens)])
            return
        self._send_events([first])
        if seq is not None:
            self.live.add(request_id)
            self.inbox.put(("admit", seq))

    def _on_abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.inbox.put(("abort", request_id))
            return
        self.aborted[request_id] = None  # its handoff may still be in flight
        while len(self.aborted) > 10_000:
            self.aborted.popitem(last=False)

    def _send_events(self, events: list[TokenEvent]) -> None:
        for event in events:
            if event.finish_reason is not None:
                self.live.discard(event.request_id)
            message = Token(event_for_gateway(event, self.engine.tokenizer))
            if not self.gateways:
                self.pending_events.append(message)
            for writer in list(self.gateways):
                asyncio.ensure_future(self._send(writer, message))

    async def _send(self, writer: asyncio.StreamWriter, message) -> None:
        try:
            await send_message(writer, message)
        except (ConnectionError, RuntimeError):
            self.gateways.discard(writer)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_message(reader)
        if not isinstance(hello, Hello):
            writer.close()
            return
        if hello.role == "gateway":
            self.gateways.add(writer)
            while self.pending_events:
                await self._send(writer, self.pending_events.popleft())
        try:
            while (message := await read_message(reader)) is not None:
                if isinstance(message, Handoff):
                    self._on_handoff(message.data)
                elif isinstance(message, Abort):
                    self._on_abort(message.request_id)
                elif isinstance(message, DecodeYield):
                    log.debug("best priority in prefill: %s", message.priority)
                    self.gate.hold(message.priority)
        finally:
            if hello.role == "gateway":
                self.gate.hold(None)  # whatever it asked for no longer holds
            self.gateways.discard(writer)
            writer.close()

    async def publish_stats(self) -> None:
        while not self.stopping.is_set():
            await asyncio.sleep(STATS_INTERVAL_S)
            message = Stats(dataclasses.asdict(self.engine.stats()))
            for writer in list(self.gateways):
                await self._send(writer, message)


def event_for_gateway(event: TokenEvent, tokenizer) -> dict:
    """The event as the gateway needs it: logprobs carry token text, which only this process can decode."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    body = dataclasses.asdict(event)
    body["logprobs"] = [
        {"id": tid, "token": text(tid), "logprob": lp,
         "top": [{"id": alt, "token": text(alt), "logprob": alt_lp} for alt, alt_lp in top]}
        for tid, lp, top in event.logprobs]
    return body


def build_engine(args: argparse.Namespace) -> DecodeEngine:
    identity = read_gguf_identity(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = load_decode_model(identity, device, dtype)
    tokenizer = load_tokenizer(identity)
    # decode and llama.cpp prefill share the cores only when decode runs on the CPU
    yields = args.yield_to_prefill == "on" or (args.yield_to_prefill == "auto" and device.type == "cpu")
    log.info("decode %s to more important prompts in prefill (--yield-to-prefill %s, device %s)",
             "yields" if yields else "does not yield", args.yield_to_prefill, device)
    runner = ModelRunner(model, identity, RunnerConfig(block_size=args.block_size, kv_storage=args.kv_storage,
                                                       kv_cache_tokens=args.kv_cache_tokens,
                                                       gpu_memory_utilization=args.gpu_memory_utilization), device,
                         PriorityGate(enabled=yields))
    eos = tuple(t for t in {tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)}
                if isinstance(t, int))
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs), max_model_len=args.max_model_len)
    return DecodeEngine(runner, config, tokenizer, eos)


async def serve(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    loop = asyncio.get_running_loop()
    service = EngineService(engine, loop)
    thread = threading.Thread(target=service.run_engine, name="engine", daemon=True)
    thread.start()
    server = await start_server(service.handle_connection, args.listen)
    stats_task = asyncio.create_task(service.publish_stats())
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("decode engine ready on %s", args.listen)
    await stop.wait()
    log.info("decode engine stopping: aborting %d in-flight requests", len(engine.sequences))
    service.stopping.set()
    await asyncio.to_thread(thread.join, 10)
    await asyncio.sleep(0.2)  # let the abort events reach the gateway
    stats_task.cancel()
    server.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="decode engine process")
    parser.add_argument("--model", required=True)
    parser.add_argument("--listen", required=True, help="unix:/path or tcp://host:port")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-storage", default="auto", help="auto, float32, float16, bfloat16 or int8")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--yield-to-prefill", default="auto", choices=["auto", "on", "off"],
                        help="pause lower-priority decode while a more important prompt is prefilled "
                             "(auto: on when decoding on the CPU, which prefill shares)")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
