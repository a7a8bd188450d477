"""The gateway's HTTPS: one server-side ssl.SSLContext from the ssl_* config keys (docs/tls.md).

Every mistake is refused at start with the key and the file it concerns: a half-configured TLS must never
fall back to plain HTTP, and OpenSSL's own errors ("PEM lib") do not say which file is wrong."""

from __future__ import annotations

import logging
import ssl
import time
from pathlib import Path

from edge.config import ServeConfig

CERTIFICATE = "-----BEGIN CERTIFICATE-----"
PRIVATE_KEY = "PRIVATE KEY-----"  # PKCS#8, RSA, EC and encrypted keys all end their BEGIN line so
EXPIRY_WARNING_DAYS = 14

log = logging.getLogger("edge.http.tls")


class TLSError(ValueError):
    """A TLS setting that cannot be used; the message names the key and the file."""


def server_context(config: ServeConfig) -> ssl.SSLContext | None:
    """None when no TLS key is set (plain HTTP); else a TLS 1.2+ server context, with ssl_ca_certs one that
    requires a client certificate signed by that CA (mutual TLS)."""
    cert, key, ca = config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
    if not (cert or key or ca):
        return None
    for name, value in (("ssl_certfile", cert), ("ssl_keyfile", key)):
        if not value:
            raise TLSError(f"{name} is not set: HTTPS needs a certificate and its key together "
                           f"(ssl_certfile and ssl_keyfile, or --ssl-certfile and --ssl-keyfile)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_identity(context, cert, key)
    if ca:
        _require_client_certificates(context, ca)
    return context


def _load_identity(context: ssl.SSLContext, cert: str, key: str) -> None:
    _check_pem("ssl_certfile", cert, CERTIFICATE, "certificate")
    _check_pem("ssl_keyfile", key, PRIVATE_KEY, "private key")

    def no_passphrase():  # without this callback OpenSSL would prompt on the terminal, which a service has not
        raise TLSError(f"ssl_keyfile {key}: the key is encrypted; a service cannot type its passphrase: store it "
                       f"unencrypted (openssl pkey -in {key} -out PLAIN.key), readable only by the service's user")
    try:
        context.load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise TLSError(f"ssl_keyfile {key} is not the private key of the certificate in ssl_certfile "
                           f"{cert}") from None
        raise TLSError(f"ssl_certfile {cert} and ssl_keyfile {key}: OpenSSL cannot load them "
                       f"({err.reason or err})") from None
    warn_if_expiring(cert)


def warn_if_expiring(cert: str, key: str = "ssl_certfile", now: float | None = None) -> str | None:
    """Log (and return) a warning when the certificate has expired or expires within EXPIRY_WARNING_DAYS:
    clients refuse an expired one, so the service would be up and unreachable. Read with the ssl module's own
    certificate decoder; where that is missing, nothing is checked."""
    try:
        not_after = ssl.cert_time_to_seconds(ssl._ssl._test_decode_cert(cert)["notAfter"])
    except (AttributeError, KeyError, ValueError, ssl.SSLError):
        return None
    days = (not_after - (time.time() if now is None else now)) / 86400
    if days >= EXPIRY_WARNING_DAYS:
        return None
    ends = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(not_after))
    message = (f"{key} {cert} expired on {ends}: TLS clients will refuse this server" if days < 0 else
               f"{key} {cert} expires on {ends}, in {days:.1f} days: renew it")
    log.warning(message)
    return message


def _require_client_certificates(context: ssl.SSLContext, ca: str) -> None:
    _check_pem("ssl_ca_certs", ca, CERTIFICATE, "CA certificate")
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as err:
        raise TLSError(f"ssl_ca_certs {ca}: OpenSSL cannot load it ({err.reason or err})") from None
    context.verify_mode = ssl.CERT_REQUIRED


def _check_pem(name: str, path: str, marker: str, what: str) -> None:
    """The file can be read and holds PEM text of the right kind (a swapped key and certificate, or a DER
    file, is named here rather than reported by OpenSSL as "PEM lib")."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as err:
        raise TLSError(f"{name} {path}: cannot read the file: {err.strerror}") from None
    if marker not in text:
        raise TLSError(f"{name} {path}: no PEM {what} in the file")
