"""Framing and the authenticated handshake of the control sockets (gateway, prefill workers, decode engine).

A frame is a u32 big-endian length and a msgpack array [type name, body]; the body decodes into the frame's
dataclass (contracts.messages) with every field type-checked, so a bad or skewed frame is a ProtocolError,
never a TypeError deep in a handler. Each reader caps the frame size it accepts: small until the peer has
proven it holds the shared secret, then what that connection can legitimately carry.

Addresses are "unix:/path" or "tcp://host:port", so a worker can run on another host. TCP peers must share a
secret (config `control_secret_file`); local sockets get one generated per launch, and live in a 0700 run dir.
A TCP link runs inside mutual TLS when the process has control certificates (contracts.control_tls): the
handshake's proofs are then bound to both certificates, and TLS protects every frame after it. A listener closes
a peer that has not passed the handshake within control_handshake_timeout_s, and holds at most
control_tls.MAX_PENDING such peers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import struct
import time

import msgspec

from contracts import PROTOCOL_VERSION, control_tls
from contracts.control_tls import ControlTLS, PendingPeers, binding, pending_slot
from contracts.messages import MESSAGES, Challenge, Hello, Refused, Welcome

HANDSHAKE_FRAME_BYTES = 64 << 10  # before authentication a peer may not make us buffer more
CONTROL_FRAME_BYTES = 16 << 20  # jobs (prompts up to the body limit), token events, stats
HANDSHAKE_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 15.0  # one try to open a connection
LISTEN_POLL_S = 0.2  # how often connect_when_listening tries while a TCP peer is not listening yet
# ... and a peer on this host's Unix socket (a failed try there costs a system call, nothing on the network): the
# links `edge serve` waits on at start (worker -> engine, gateway -> worker, gateway -> engine) follow their peer
# within this, each a step of the start-up's path to ready
LOCAL_POLL_S = 0.05
SECRET_ENV = "EDGE_CONTROL_SECRET"  # hex; the launcher passes the per-launch secret to its children this way

_BY_NAME = {cls.__name__: cls for cls in MESSAGES}
_DECODERS = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in MESSAGES}
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_ENCODER = msgspec.msgpack.Encoder()
log = logging.getLogger("contracts.framing")


class ProtocolError(RuntimeError):
    """A peer sent a frame this build does not understand (malformed, unknown, too large)."""


class TLSBrokenError(ProtocolError):
    """TLS ended the connection: a record that failed its integrity check (altered on the way), or the peer's
    alert (a certificate it refused)."""


class PeerRefusedError(ConnectionError):
    """The handshake failed: wrong secret, protocol version skew, an impostor listener, or (TLS) a certificate."""


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
    except ssl.SSLError as err:
        raise TLSBrokenError(f"the TLS connection broke: {err.reason or err}") from None


async def send_message(writer: asyncio.StreamWriter, message) -> None:
    writer.write(pack(message))
    try:
        await writer.drain()
    except ssl.SSLError as err:  # the connection is gone, as for a reset
        raise ConnectionResetError(f"the TLS connection broke: {err.reason or err}") from None


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
    (the peer was told why and the connection is closed). The whole exchange has the listener's handshake time
    limit (start_server's), and ends the connection's pending slot either way."""
    nonce = secrets.token_bytes(16)
    bound = binding(writer, listener=True)
    slot = pending_slot.get()
    try:
        async with asyncio.timeout(slot.timeout_s if slot else control_tls.current().handshake_timeout_s):
            await send_message(writer, Challenge(PROTOCOL_VERSION, nonce))
            hello = await read_message(reader, HANDSHAKE_FRAME_BYTES)
            reason = _check_hello(hello, secret, nonce, bound)
            if reason is None:
                await send_message(writer, Welcome(_proof(secret, b"welcome", hello.nonce, nonce, bound)))
                return hello
            await send_message(writer, Refused(reason))
    except (TimeoutError, ProtocolError, ConnectionError):
        pass
    finally:
        if slot is not None:
            slot.release()
    writer.close()
    return None


def _check_hello(hello, secret: bytes, nonce: bytes, bound: bytes) -> str | None:
    if not isinstance(hello, Hello):
        return f"expected Hello, got {type(hello).__name__}"
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"protocol version {hello.protocol_version} is not this peer's version {PROTOCOL_VERSION}; "
                f"run the same edge-llm build on both sides")
    expected = _proof(secret, b"hello", nonce, hello.role.encode(), hello.name.encode(), hello.nonce, bound)
    if not hmac.compare_digest(expected, hello.proof):
        if bound:
            return ("authentication failed: the peers do not share the same control secret, or a relay stands "
                    "between them (the certificates each side sees differ)")
        return "authentication failed: the peers do not share the same control secret"
    return None


async def introduce(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str, name: str,
                    secret: bytes) -> None:
    """Connecting side: answer the challenge; raises PeerRefusedError with the reason if refused."""
    bound = binding(writer, listener=False)
    challenge = await _handshake_frame(reader, bound)
    if challenge is None:
        raise PeerRefusedError("the listener closed the connection before its challenge" + (
            " (a TLS listener that refuses this peer's certificate does so: is it signed by the listener's "
            "control_tls_ca?)" if bound else " (a listener with control TLS closes a plain connection: then give "
                                             "this process the control_tls_* files too; a listener with too many "
                                             "handshakes pending closes new ones)"))
    if not isinstance(challenge, Challenge):
        raise PeerRefusedError(f"the listener did not start a handshake (got {type(challenge).__name__})")
    if challenge.protocol_version != PROTOCOL_VERSION:
        raise PeerRefusedError(f"the listener speaks protocol version {challenge.protocol_version}, this peer "
                               f"{PROTOCOL_VERSION}; run the same edge-llm build on both sides")
    nonce = secrets.token_bytes(16)
    proof = _proof(secret, b"hello", challenge.nonce, role.encode(), name.encode(), nonce, bound)
    await send_message(writer, Hello(role, name, PROTOCOL_VERSION, nonce, proof))
    answer = await _handshake_frame(reader, bound)
    if isinstance(answer, Refused):
        raise PeerRefusedError(f"refused by the listener: {answer.reason}")
    if not isinstance(answer, Welcome) or not hmac.compare_digest(
            answer.proof, _proof(secret, b"welcome", nonce, challenge.nonce, bound)):
        raise PeerRefusedError("the listener could not prove it holds the control secret")


async def _handshake_frame(reader: asyncio.StreamReader, bound: bytes):
    try:
        return await asyncio.wait_for(read_message(reader, HANDSHAKE_FRAME_BYTES), HANDSHAKE_TIMEOUT_S)
    except TLSBrokenError as err:  # TLS 1.3: the listener checks this peer's certificate after our side is done
        raise PeerRefusedError(f"{err} (does the listener's control_tls_ca sign this peer's certificate?)") from None


# --- addresses and connections ----------------------------------------------------------------------
async def open_connection(address: str, tls: ControlTLS | None = None):
    """A Unix socket as it is; TCP inside TLS with the process's control certificates (or `tls`), else plain
    to a loopback address or with allow_plaintext_control (PlaintextControlError otherwise)."""
    kind, target = parse_address(address)
    if kind == "unix":
        return await asyncio.open_unix_connection(target, limit=1 << 20)
    host, port = target
    tls = tls or control_tls.current()
    tls.refuse_plaintext(address, host)
    if not tls.on:
        return await asyncio.open_connection(host, port, limit=1 << 20)
    return await asyncio.open_connection(host, port, limit=1 << 20, ssl=tls.client_context,
                                         ssl_handshake_timeout=tls.handshake_timeout_s)


async def connect_when_listening(address: str, role: str, name: str, secret: bytes,
                                 timeout_s: float | None = None, tls: ControlTLS | None = None):
    """Connect once the peer listens (it may still be loading its model), then pass the handshake.
    A refusal (wrong secret, version skew, a certificate) raises PeerRefusedError at once: retrying would not
    help."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:  # bounded: a TCP peer that drops SYNs would otherwise hold one try for minutes
            reader, writer = await asyncio.wait_for(open_connection(address, tls), OPEN_TIMEOUT_S)
            break
        except ssl.SSLError as err:  # a certificate either side refused, or a listener that speaks no TLS
            raise PeerRefusedError(f"the TLS handshake with {address} failed: {err.reason or err} (both sides "
                                   f"need certificates of the same control_tls_ca)") from None
        except OSError:  # not listening yet (no socket file, refused), unreachable, or no answer (TimeoutError)
            if deadline is not None and time.monotonic() > deadline:
                raise
            await asyncio.sleep(LOCAL_POLL_S if address.startswith("unix:") else LISTEN_POLL_S)
    try:
        await introduce(reader, writer, role, name, secret)
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def start_server(handler, address: str, tls: ControlTLS | None = None) -> asyncio.AbstractServer:
    """Serve `handler(reader, writer)` on a Unix socket, or on TCP inside TLS with the process's control
    certificates (or `tls`; plain only on loopback or with allow_plaintext_control). The handler's accept_peer
    has the handshake time limit; a connection beyond MAX_PENDING unauthenticated ones is closed at once."""
    tls = tls or control_tls.current()
    guarded = _guarded(handler, tls.handshake_timeout_s)
    kind, target = parse_address(address)
    if kind == "unix":
        server = await asyncio.start_unix_server(guarded, target, limit=1 << 20)
        os.chmod(target, 0o600)  # only this user may connect (the run dir is 0700 as well)
        return server
    host, port = target
    tls.refuse_plaintext(address, host)
    if not tls.on:
        return await asyncio.start_server(guarded, host, port, limit=1 << 20)
    # a TCP peer that never finishes the TLS handshake is closed by asyncio at the same limit
    return await asyncio.start_server(guarded, host, port, limit=1 << 20, ssl=tls.server_context,
                                      ssl_handshake_timeout=tls.handshake_timeout_s)


def _guarded(handler, timeout_s: float):
    peers = PendingPeers(timeout_s)

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not peers.can_admit():
            peers.num_refused += 1
            if peers.num_refused % 1000 == 1:  # once per burst, not once per connection
                log.warning("closing a control connection: %d others have not finished the handshake yet "
                            "(%d closed so far)", peers.num_pending, peers.num_refused)
            writer.close()
            return
        slot = peers.admit()
        pending_slot.set(slot)
        try:
            await handler(reader, writer)
        finally:
            slot.release()
    return guarded


def refuse_plaintext_links(addresses, tls: ControlTLS | None = None) -> None:
    """PlaintextControlError for the first TCP address off loopback that would run without TLS."""
    tls = tls or control_tls.current()
    for address in addresses:
        kind, target = parse_address(address)
        if kind == "tcp":
            tls.refuse_plaintext(address, target[0])


def parse_address(address: str):
    if address.startswith("unix:"):
        return "unix", address[len("unix:"):]
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad TCP address {address!r}; expected tcp://host:port")
        return "tcp", (host, int(port))
    raise ValueError(f"bad address {address!r}; expected unix:/path or tcp://host:port")
