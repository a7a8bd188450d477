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
from decode_gpu.engine import DecodeEngine, EngineConfig, HandoffRejectedError
from decode_gpu.model_loader import load_decode_model, load_tokenizer
from decode_gpu.model_runner import ModelRunner, RunnerConfig
from decode_gpu.priority_gate import PriorityGate
from decode_gpu.scheduler import SchedulerConfig
from contracts.events import FinishReason, TokenEvent
from contracts.framing import (CONTROL_FRAME_BYTES, ProtocolError, accept_peer, control_secret, read_message,
                               send_message, start_server)
from contracts.handoff import HandoffFormatError, decode_handoff, max_handoff_bytes
from contracts.identity import read_gguf_identity
from contracts.messages import Abort, DecodeYield, Handoff, Stats, Token

log = logging.getLogger("decode_gpu.server")
STATS_INTERVAL_S = 0.5


class EngineService:
    def __init__(self, engine: DecodeEngine, loop: asyncio.AbstractEventLoop, secret: bytes = b"",
                 max_handoff_frame: int = CONTROL_FRAME_BYTES) -> None:
        self.engine = engine
        self.gate: PriorityGate = engine.runner.gate or PriorityGate(enabled=False)
        self.loop = loop
        self.secret = secret
        self.max_handoff_frame = max_handoff_frame  # the model's largest possible handoff, framed
        self.inbox: queue.Queue = queue.Queue()  # ("admit", Sequence) or ("abort", request id), in arrival order
        self.gateways: set[asyncio.StreamWriter] = set()
        # terminal events of requests that ended while no gateway was connected; the gateway may still be
        # waiting for them (a prompt in prefill during a reconnect). Bounded: a gateway gone for good
        # ends its own requests, and the oldest endings go first.
        self.pending_endings: collections.OrderedDict[str, Token] = collections.OrderedDict()
        self.live: set[str] = set()  # opened and not yet ended (asyncio side)
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborts seen before the handoff
        self.snapshot = engine.stats()  # published by the engine thread; other threads never read engine state
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
            self.snapshot = self.engine.stats()
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
            return [TokenEvent.ending(seq.seq_id, FinishReason.ERROR, str(err), seq.prompt_len)]

    def _abort(self, request_id: str) -> list[TokenEvent]:
        event = self.engine.abort(request_id)
        return [] if event is None else [event]  # None: it ended on its own in the meantime

    def _fail_all(self, why: str) -> list[TokenEvent]:
        events = []
        for request_id in list(self.engine.sequences):
            event = self.engine.abort(request_id)
            events.append(dataclasses.replace(event, finish_reason=FinishReason.ERROR, error=why))
        return events

    def _abort_all(self) -> list[TokenEvent]:
        return [self.engine.abort(request_id) for request_id in list(self.engine.sequences)]

    def _publish(self, events: list[TokenEvent]) -> None:
        if events:
            self.loop.call_soon_threadsafe(self._send_events, events)

    # --- asyncio side ------------------------------------------------------------------------
    def _on_handoff(self, message: Handoff) -> None:
        request_id = message.request_id
        try:
            handoff = decode_handoff(message.data)
            if handoff.request_id != request_id:
                raise HandoffFormatError(f"the frame says request {request_id}, the handoff {handoff.request_id}")
        except HandoffFormatError as err:
            log.error("handoff %s is malformed: %s", request_id, err)
            self._send_events([TokenEvent.ending(request_id, FinishReason.ERROR, f"malformed KV handoff: {err}")])
            return
        if request_id in self.aborted:  # the client went away while it was being prefilled
            del self.aborted[request_id]
            self._send_events([TokenEvent.ending(request_id, FinishReason.ABORT, num_prompt_tokens=handoff.n_tokens)])
            return
        try:
            if request_id in self.live:
                raise HandoffRejectedError(f"request id {request_id} is already decoding")
            seq, first = self.engine.open(handoff)
        except HandoffRejectedError as err:
            log.error("handoff %s rejected: %s", request_id, err)
            self._send_events([TokenEvent.ending(request_id, FinishReason.ERROR, str(err), handoff.n_tokens)])
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
            message = Token(with_token_text(event, self.engine.tokenizer))
            if not self.gateways:
                self._keep_ending(message)
            for writer in list(self.gateways):
                asyncio.ensure_future(self._send(writer, message))

    def _keep_ending(self, message: Token) -> None:
        """No gateway to tell: keep terminal events for its return; a live sequence has nobody to stream to."""
        event = message.event
        if event.finish_reason is None:
            self._on_abort(event.request_id)
            return
        self.pending_endings[event.request_id] = message
        while len(self.pending_endings) > 10_000:
            self.pending_endings.popitem(last=False)

    async def _send(self, writer: asyncio.StreamWriter, message) -> None:
        try:
            await send_message(writer, message)
        except (ConnectionError, RuntimeError):
            self.gateways.discard(writer)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await accept_peer(reader, writer, self.secret)
        if hello is None:
            log.warning("refused a control connection that failed the handshake")
            return
        limit = self.max_handoff_frame if hello.role == "prefill" else CONTROL_FRAME_BYTES
        if hello.role == "gateway":
            self.gateways.add(writer)
            while self.pending_endings:
                await self._send(writer, self.pending_endings.popitem(last=False)[1])
        try:
            while (message := await read_message(reader, limit)) is not None:
                self._dispatch(message)
        except ProtocolError as err:  # drop this peer; it reconnects
            log.error("dropping %s %s after a bad frame: %s", hello.role, hello.name, err)
        finally:
            if hello.role == "gateway":
                self.gate.hold(None)  # whatever it asked for no longer holds
            self.gateways.discard(writer)
            writer.close()

    def _dispatch(self, message) -> None:
        if isinstance(message, Handoff):
            self._on_handoff(message)
        elif isinstance(message, Abort):
            self._on_abort(message.request_id)
        elif isinstance(message, DecodeYield):
            log.debug("best priority in prefill: %s", message.priority)
            self.gate.hold(message.priority)
        else:
            log.warning("ignoring an unexpected %s frame", type(message).__name__)

    async def publish_stats(self) -> None:
        while not self.stopping.is_set():
            await asyncio.sleep(STATS_INTERVAL_S)
            message = Stats(self.snapshot)
            for writer in list(self.gateways):
                await self._send(writer, message)


def with_token_text(event: TokenEvent, tokenizer) -> TokenEvent:
    """Logprobs carry token text, which only this process can decode."""
    if not event.logprobs:
        return event

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    logprobs = tuple(dataclasses.replace(lp, token=text(lp.token_id),
                                         top=tuple(dataclasses.replace(t, token=text(t.token_id)) for t in lp.top))
                     for lp in event.logprobs)
    return dataclasses.replace(event, logprobs=logprobs)


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
    identity = engine.runner.identity
    max_frame = max_handoff_bytes(identity.n_layer, identity.num_kv_heads, identity.head_dim_k,
                                  identity.head_dim_v, args.max_model_len)
    service = EngineService(engine, loop, control_secret(args.listen), max_frame)
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
