"""TLS on the TCP control links, and the limits on peers that have not authenticated yet (docs/security.md,
"Network").

With `control_tls_certfile`, `control_tls_keyfile` and `control_tls_ca` a TCP control link (gateway -> workers,
gateway -> engines, worker -> engines) runs inside mutual TLS 1.3: each process presents its certificate and
accepts only a peer whose certificate that CA signed. The HMAC handshake of contracts.framing still runs inside,
its proofs bound to both certificates: the shared secret still names the cluster, and a holder of some other
certificate of the same CA cannot relay between two real peers. TLS then protects every frame after it: a relay
reads nothing, and a byte it alters breaks the connection instead of delivering a frame.

Unix sockets stay plain (one host, a 0700 run dir). Plain TCP on or to an address that is not loopback is refused
unless `allow_plaintext_control` is set. A peer must finish both handshakes within `control_handshake_timeout_s`,
and a listener keeps at most MAX_PENDING peers that have not finished the HMAC handshake.

A process sets its settings once at start (`configure`); the framing functions read them unless a caller (a test)
passes its own.
"""

from __future__ import annotations

import contextvars
import hashlib
import ipaddress
import ssl
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from contracts.options import KNOBS

KEYS = ("control_tls_certfile", "control_tls_keyfile", "control_tls_ca")
MAX_PENDING = 64  # per listener: connections not yet past the HMAC handshake; more are closed at once
CERTIFICATE = "-----BEGIN CERTIFICATE-----"
END_CERTIFICATE = "-----END CERTIFICATE-----"
PRIVATE_KEY = "PRIVATE KEY-----"  # PKCS#8, RSA, EC and encrypted keys all end their BEGIN line so


class ControlTLSError(ValueError):
    """A control TLS setting that cannot be used; the message names the setting and the file."""


class PlaintextControlError(ValueError):
    """Plain TCP on or to an address that is not loopback, without allow_plaintext_control."""


class _ControlContext(ssl.SSLContext):
    """An SSLContext that knows the certificate it presents: the handshake's proofs are bound to it."""

    own_certificate: bytes = b""  # DER


@dataclass(frozen=True)
class ControlTLS:
    certfile: str = ""
    keyfile: str = ""
    ca: str = ""
    allow_plaintext: bool = KNOBS["allow_plaintext_control"].default
    handshake_timeout_s: float = KNOBS["control_handshake_timeout_s"].default

    @classmethod
    def of(cls, config) -> ControlTLS:
        """From any config holding the control_* knobs (the serve config, a child's process config)."""
        return cls(config.control_tls_certfile, config.control_tls_keyfile, config.control_tls_ca,
                   config.allow_plaintext_control, config.control_handshake_timeout_s)

    @property
    def on(self) -> bool:
        return bool(self.certfile or self.keyfile or self.ca)

    def check(self) -> ControlTLS:
        """Self, once every file loads; ControlTLSError naming the setting and the file otherwise. A half-given
        TLS must never fall back to plain TCP."""
        if self.on:
            values = dict(zip(KEYS, (self.certfile, self.keyfile, self.ca), strict=True))
            missing = [key for key, value in values.items() if not value]
            if missing:
                raise ControlTLSError(f"{', '.join(missing)} not set: TLS on the control links needs all of "
                                      f"{', '.join(KEYS)} (mutual TLS: every process presents a certificate the CA "
                                      f"signed and checks its peer's)")
            _ = self.server_context, self.client_context
        return self

    @cached_property
    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    @cached_property
    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_CLIENT)

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = _ControlContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3  # every peer runs the same build
        # peers are known by their CA, not by their address (Ray moves them between nodes): the control CA must
        # sign control-plane certificates only (docs/security.md)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.own_certificate = _first_certificate("control_tls_certfile", self.certfile)
        _check_pem("control_tls_keyfile", self.keyfile, PRIVATE_KEY, "private key")

        def no_passphrase():  # else OpenSSL would prompt on a terminal the service does not have
            raise ControlTLSError(f"control_tls_keyfile {self.keyfile}: the key is encrypted; store it unencrypted, "
                                  f"readable only by the service's user")
        try:
            context.load_cert_chain(self.certfile, self.keyfile, password=no_passphrase)
        except ssl.SSLError as err:
            raise ControlTLSError(f"control_tls_certfile {self.certfile} and control_tls_keyfile {self.keyfile}: "
                                  f"{_openssl_reason(err)}") from None
        _check_pem("control_tls_ca", self.ca, CERTIFICATE, "CA certificate")
        try:
            context.load_verify_locations(cafile=self.ca)
        except ssl.SSLError as err:
            raise ControlTLSError(f"control_tls_ca {self.ca}: OpenSSL cannot load it ({err.reason or err})") from None
        return context

    def refuse_plaintext(self, address: str, host: str) -> None:
        """PlaintextControlError for plain TCP on or to `host` unless it is loopback or plaintext is allowed."""
        if self.on or self.allow_plaintext or is_loopback(host):
            return
        raise PlaintextControlError(
            f"{address}: control frames (prompts, tokens) would cross the network in clear, readable and forgeable "
            f"on the way; give control_tls_certfile, control_tls_keyfile and control_tls_ca (docs/security.md), or "
            f"set allow_plaintext_control = true (--allow-plaintext-control) on a network you trust")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def binding(writer, listener: bool) -> bytes:
    """What the handshake's proofs are bound to: SHA-256 of the listener's and of the connecting peer's
    certificate (RFC 5929's tls-server-end-point, for both ends); b"" on a plain connection. A relay that holds a
    certificate of the same CA presents its own to each side, so each side's proof covers a different pair."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    own = getattr(ssl_object.context, "own_certificate", b"")
    peer = ssl_object.getpeercert(binary_form=True) or b""
    server, client = (own, peer) if listener else (peer, own)
    return hashlib.sha256(server).digest() + hashlib.sha256(client).digest()


# --- the process's settings ---------------------------------------------------------------------------
_current = ControlTLS()


def configure(tls: ControlTLS) -> ControlTLS:
    """This process's control TLS from now on (checked: every file loads); set once at start."""
    global _current
    _current = tls.check()
    return _current


def current() -> ControlTLS:
    return _current


# --- peers that have not authenticated yet ------------------------------------------------------------
class PendingPeers:
    """A listener's count of connections not yet past the HMAC handshake, and the time each may take."""

    def __init__(self, timeout_s: float, limit: int = MAX_PENDING) -> None:
        self.timeout_s, self.limit = timeout_s, limit
        self.num_pending = 0
        self.num_refused = 0

    def can_admit(self) -> bool:
        return self.num_pending < self.limit

    def admit(self) -> _Slot:
        self.num_pending += 1
        return _Slot(self)


class _Slot:
    def __init__(self, peers: PendingPeers) -> None:
        self.peers: PendingPeers | None = peers
        self.timeout_s = peers.timeout_s

    def release(self) -> None:
        """Once, when the handshake ended (either way) or the connection did."""
        if self.peers is not None:
            self.peers.num_pending -= 1
            self.peers = None


# the slot of the connection this task serves: the listener's wrapper sets it, accept_peer releases it
pending_slot: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("pending_slot", default=None)


def _first_certificate(name: str, path: str) -> bytes:
    """The DER of the first certificate in the file: the one this process presents (intermediates follow it)."""
    text = _check_pem(name, path, CERTIFICATE, "certificate")
    start = text.index(CERTIFICATE)
    end = text.find(END_CERTIFICATE, start)
    try:
        return ssl.PEM_cert_to_DER_cert(text[start:end + len(END_CERTIFICATE)] if end >= 0 else "")
    except ValueError:
        raise ControlTLSError(f"{name} {path}: the PEM certificate in the file is cut short") from None


def _check_pem(name: str, path: str, marker: str, what: str) -> str:
    """The file's text, once it can be read and holds PEM text of the right kind (a swapped key and certificate
    is named here rather than reported by OpenSSL as "PEM lib")."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as err:
        raise ControlTLSError(f"{name} {path}: cannot read the file: {err.strerror}") from None
    if marker not in text:
        raise ControlTLSError(f"{name} {path}: no PEM {what} in the file")
    return text


def _openssl_reason(err: ssl.SSLError) -> str:
    if err.reason == "KEY_VALUES_MISMATCH":
        return "the key is not the certificate's"
    return f"OpenSSL cannot load them ({err.reason or err})"
