"""Framing and the authenticated handshake of the control sockets (gateway, prefill workers, decode engine).

A frame is a u32 big-endian length and a msgpack array [type name, body]; the body decodes into the frame's
dataclass (contracts.messages) with every field type-checked, so a bad or skewed frame is a ProtocolError,
never a TypeError deep in a handler. Each reader caps the frame size it accepts: small until the peer has
proven it holds the shared secret, then what that connection can legitimately carry.

Addresses are "unix:/path" or "tcp://host:port", so a worker can run on another host. TCP peers must share a
secret (config `control_secret_file`); local sockets get one generated per launch, and live in a 0700 run dir.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import struct
import time

import msgspec

from contracts import PROTOCOL_VERSION
from contracts.messages import MESSAGES, Challenge, Hello, Refused, Welcome

HANDSHAKE_FRAME_BYTES = 64 << 10  # before authentication a peer may not make us buffer more
CONTROL_FRAME_BYTES = 16 << 20  # jobs (prompts up to the body limit), token events, stats
HANDSHAKE_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 15.0  # one try to open a connection
LISTEN_POLL_S = 0.2  # how often connect_when_listening tries while the peer is not listening yet
SECRET_ENV = "EDGE_CONTROL_SECRET"  # hex; the launcher passes the per-launch secret to its children this way

_BY_NAME = {cls.__name__: cls for cls in MESSAGES}
_DECODERS = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in MESSAGES}
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_ENCODER = msgspec.msgpack.Encoder()


class ProtocolError(RuntimeError):
    """A peer sent a frame this build does not understand (malformed, unknown, too large)."""


class PeerRefusedError(ConnectionError):
    """The handshake failed: wrong secret, protocol version skew, or an impostor listener."""


def pack(message) -> bytes:
    """Raises msgspec.EncodeError (a ValueError-like error) for values that cannot travel, e.g. lone surrogates."""
    name = type(message).__name__
    if name not in _BY_NAME:
        raise TypeError(f"{name} is not a control frame")
    body = _ENCODER.encode((name, message))
    return struct.pack(">I", len(body)) + body


def unpack(body: bytes):
    try:
        name, raw = _ENVELOPE.decode(body)
        decoder = _DECODERS.get(name)
        if decoder is None:
            raise ProtocolError(f"unknown frame type {name[:40]!r}")
        return decoder.decode(raw)
    except msgspec.DecodeError as err:
        raise ProtocolError(f"malformed frame: {err}") from None


async def read_message(reader: asyncio.StreamReader, max_bytes: int = CONTROL_FRAME_BYTES):
    """Next message, or None when the peer closed the connection. Raises ProtocolError for a bad frame."""
    try:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > max_bytes:
            raise ProtocolError(f"frame of {size} bytes exceeds this connection's limit of {max_bytes}")
        return unpack(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def send_message(writer: asyncio.StreamWriter, message) -> None:
    writer.write(pack(message))
    await writer.drain()


# --- the handshake ----------------------------------------------------------------------------------
def control_secret(address: str | None = None) -> bytes:
    """The shared secret from the environment; TCP addresses refuse to run without one."""
    value = os.environ.get(SECRET_ENV, "")
    if not value and address is not None and parse_address(address)[0] == "tcp":
        raise ValueError(f"{address} is a TCP address: its peers must authenticate, so set a shared secret "
                         f"(config control_secret_file, or {SECRET_ENV} for a process started by hand)")
    return value.encode()


def new_secret() -> str:
    return secrets.token_hex(32)


def _proof(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


async def accept_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> Hello | None:
    """Listener side: challenge the peer; its Hello when it proved the secret and speaks our version, else None
    (the peer was told why and the connection is closed)."""
    nonce = secrets.token_bytes(16)
    try:
        await send_message(writer, Challenge(PROTOCOL_VERSION, nonce))
        hello = await asyncio.wait_for(read_message(reader, HANDSHAKE_FRAME_BYTES), HANDSHAKE_TIMEOUT_S)
        reason = _check_hello(hello, secret, nonce)
        if reason is None:
            await send_message(writer, Welcome(_proof(secret, b"welcome", hello.nonce, nonce)))
            return hello
        await send_message(writer, Refused(reason))
    except (TimeoutError, ProtocolError, ConnectionError):
        pass
    writer.close()
    return None


def _check_hello(hello, secret: bytes, nonce: bytes) -> str | None:
    if not isinstance(hello, Hello):
        return f"expected Hello, got {type(hello).__name__}"
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"protocol version {hello.protocol_version} is not this peer's version {PROTOCOL_VERSION}; "
                f"run the same edge-llm build on both sides")
    expected = _proof(secret, b"hello", nonce, hello.role.encode(), hello.name.encode(), hello.nonce)
    if not hmac.compare_digest(expected, hello.proof):
        return "authentication failed: the peers do not share the same control secret"
    return None


async def introduce(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str, name: str,
                    secret: bytes) -> None:
    """Connecting side: answer the challenge; raises PeerRefusedError with the reason if refused."""
    challenge = await asyncio.wait_for(read_message(reader, HANDSHAKE_FRAME_BYTES), HANDSHAKE_TIMEOUT_S)
    if not isinstance(challenge, Challenge):
        raise PeerRefusedError(f"the listener did not start a handshake (got {type(challenge).__name__})")
    if challenge.protocol_version != PROTOCOL_VERSION:
        raise PeerRefusedError(f"the listener speaks protocol version {challenge.protocol_version}, this peer "
                               f"{PROTOCOL_VERSION}; run the same edge-llm build on both sides")
    nonce = secrets.token_bytes(16)
    proof = _proof(secret, b"hello", challenge.nonce, role.encode(), name.encode(), nonce)
    await send_message(writer, Hello(role, name, PROTOCOL_VERSION, nonce, proof))
    answer = await asyncio.wait_for(read_message(reader, HANDSHAKE_FRAME_BYTES), HANDSHAKE_TIMEOUT_S)
    if isinstance(answer, Refused):
        raise PeerRefusedError(f"refused by the listener: {answer.reason}")
    if not isinstance(answer, Welcome) or not hmac.compare_digest(
            answer.proof, _proof(secret, b"welcome", nonce, challenge.nonce)):
        raise PeerRefusedError("the listener could not prove it holds the control secret")


# --- addresses and connections ----------------------------------------------------------------------
async def open_connection(address: str):
    kind, target = parse_address(address)
    if kind == "unix":
        return await asyncio.open_unix_connection(target, limit=1 << 20)
    host, port = target
    return await asyncio.open_connection(host, port, limit=1 << 20)


async def connect_when_listening(address: str, role: str, name: str, secret: bytes,
                                 timeout_s: float | None = None):
    """Connect once the peer listens (it may still be loading its model), then pass the handshake.
    A refusal (wrong secret, version skew) raises PeerRefusedError at once: retrying would not help."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:  # bounded: a TCP peer that drops SYNs would otherwise hold one try for minutes
            reader, writer = await asyncio.wait_for(open_connection(address), OPEN_TIMEOUT_S)
            break
        except OSError:  # not listening yet (no socket file, refused), unreachable, or no answer (TimeoutError)
            if deadline is not None and time.monotonic() > deadline:
                raise
            await asyncio.sleep(LISTEN_POLL_S)
    try:
        await introduce(reader, writer, role, name, secret)
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def start_server(handler, address: str) -> asyncio.AbstractServer:
    kind, target = parse_address(address)
    if kind == "unix":
        server = await asyncio.start_unix_server(handler, target, limit=1 << 20)
        os.chmod(target, 0o600)  # only this user may connect (the run dir is 0700 as well)
        return server
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
