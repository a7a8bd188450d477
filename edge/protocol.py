"""Control messages between the gateway, the prefill workers and the decode engine, and their framing.

Every frame is a u32 big-endian length followed by one msgpack map with a "type" key. KV handoffs travel
inside a `Handoff` frame as the bytes of prefill_cpu.handoff (that module owns the handoff format).
Addresses are "unix:/path" or "tcp://host:port", so a worker can run on another host.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import asdict, dataclass, fields

import msgpack

MAX_FRAME_BYTES = 1 << 30  # a 1 GiB frame is a bug or an attack, not a handoff


class ProtocolError(RuntimeError):
    """A peer sent a frame this build does not understand."""


@dataclass(frozen=True)
class Hello:  # first frame on every connection: who is speaking
    role: str  # "gateway" or "prefill"
    name: str = ""


@dataclass(frozen=True)
class PrefillJob:  # gateway -> prefill worker
    request_id: str
    sampling: dict  # prefill_cpu.handoff.SamplingParams fields
    priority: int = 0
    prompt: str | None = None  # plain completion text
    messages: list | None = None  # chat messages, rendered with the GGUF's chat template
    prompt_tokens: list | None = None  # already tokenized prompt
    max_prompt_tokens: int = 2048
    kv_type: str = ""  # "" -> the worker's configured KV type; a degradation tier may ask for "q4_0"
    max_total_tokens: int = 0  # prompt + max_tokens must fit this (the decode side's context); 0: unchecked


@dataclass(frozen=True)
class PrefillDone:  # prefill worker -> gateway, after the handoff went to the engine
    request_id: str
    num_prompt_tokens: int
    prefill_ms: float
    handoff_bytes: int
    handoff_ms: float  # export + encode + send
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prompt cache


@dataclass(frozen=True)
class PrefillFailed:  # prefill worker -> gateway
    request_id: str
    kind: str  # "prompt_too_long", "context_exceeded", "bad_prompt", "cancelled", "worker_died", "internal"
    message: str
    num_prompt_tokens: int = 0
    limit: int = 0


@dataclass(frozen=True)
class CancelPrefill:  # gateway -> prefill worker
    request_id: str


@dataclass(frozen=True)
class Handoff:  # prefill worker -> decode engine
    data: bytes  # prefill_cpu.handoff.encode_handoff(...)


@dataclass(frozen=True)
class Abort:  # gateway -> decode engine
    request_id: str


@dataclass(frozen=True)
class DecodeYield:  # gateway -> decode engine: best priority among prompts queued or prefilling (None: none)
    priority: int | None


@dataclass(frozen=True)
class Token:  # decode engine -> gateway: decode_gpu.engine.TokenEvent fields
    event: dict


@dataclass(frozen=True)
class Stats:  # decode engine -> gateway, periodically: decode_gpu.engine.EngineStats fields
    stats: dict


@dataclass(frozen=True)
class WorkerStatus:  # prefill worker -> gateway, on connect
    name: str
    model_fingerprint: str
    n_ctx: int
    kv_type: str


MESSAGES = {cls.__name__: cls for cls in (Hello, PrefillJob, PrefillDone, PrefillFailed, CancelPrefill, Handoff,
                                          Abort, DecodeYield, Token, Stats, WorkerStatus)}


def pack(message) -> bytes:
    body = msgpack.packb({"type": type(message).__name__, **asdict(message)}, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def unpack(body: bytes):
    data = msgpack.unpackb(body, raw=False)
    cls = MESSAGES.get(data.pop("type", None)) if isinstance(data, dict) else None
    if cls is None:
        raise ProtocolError(f"unknown frame: {str(data)[:80]}")
    names = {f.name for f in fields(cls)}
    if not set(data) <= names:
        raise ProtocolError(f"{cls.__name__} frame has unknown fields {sorted(set(data) - names)}")
    return cls(**data)


async def read_message(reader: asyncio.StreamReader):
    """Next message, or None when the peer closed the connection."""
    try:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
        return unpack(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def send_message(writer: asyncio.StreamWriter, message) -> None:
    writer.write(pack(message))
    await writer.drain()


async def open_connection(address: str):
    kind, target = parse_address(address)
    if kind == "unix":
        return await asyncio.open_unix_connection(target, limit=1 << 20)
    host, port = target
    return await asyncio.open_connection(host, port, limit=1 << 20)


async def connect_when_listening(address: str, hello: Hello, timeout_s: float | None = None):
    """Connect once the peer listens (it may still be loading its model), then introduce ourselves."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await open_connection(address)
            break
        except (FileNotFoundError, ConnectionError, OSError):
            if deadline is not None and time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    await send_message(writer, hello)
    return reader, writer


async def start_server(handler, address: str) -> asyncio.AbstractServer:
    kind, target = parse_address(address)
    if kind == "unix":
        return await asyncio.start_unix_server(handler, target, limit=1 << 20)
    host, port = target
    return await asyncio.start_server(handler, host, port, limit=1 << 20)


def parse_address(address: str):
    if address.startswith("unix:"):
        return "unix", address[len("unix:"):]
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad TCP address {address!r}; expected tcp://host:port")
        return "tcp", (host, int(port))
    raise ValueError(f"bad address {address!r}; expected unix:/path or tcp://host:port")
