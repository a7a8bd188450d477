"""The cache salt of a request: which earlier prompts its prefill may reuse from the prompt caches.

A prompt that starts like a cached one is served much faster (its prefix is not computed again), so a client
who may reuse another tenant's cached prompts can time guesses of their text. The prompt caches (the prefill
worker's and the decode engine's) therefore share KV only between requests of one salt, which the gateway
derives here, per API key by default. Keys the policy puts in one group (prefix_cache.groups: one team's keys, or
the keys of everyone who uses a public system prompt) share one salt: sharing is named, never implied. A salt the
client sends (`cache_salt`, as vLLM names it) only narrows sharing further: it is mixed with the key's (or its
group's), so a client who copies another's salt still gets a different one. Ray routing affinity
(edge.core.affinity.prefix_key) is keyed by the same salt, so a prompt follows only its own tenant's cached prefixes.

The derivation is keyed with a secret, so the salt of one key cannot be computed from the outside. It is drawn
at start-up, unless the prompt caches outlive a restart (the workers' disk tier, `kv_disk_bytes`): then it is
kept in a 0600 file beside them (`secret_file`), so a tenant's stored prefixes keep their salt across restarts
and stay theirs alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path

from contracts.cache import cache_root

log = logging.getLogger(__name__)
SECRET_BYTES = 32

SCOPES = ("key", "shared")  # the policy's prefix_cache.scope: per API key (or tenant), or one cache for all
MAX_CLIENT_SALT_CHARS = 256


class CacheSalter:
    def __init__(self, secret: bytes | None = None, secret_file: Path | None = None) -> None:
        self._secret = secret or (kept_secret(secret_file) if secret_file else secrets.token_bytes(SECRET_BYTES))

    def salt(self, scope: str, key_id: str | None, tenant: str | None, client_salt: str = "",
             group: str | None = None) -> str:
        """The salt of a request. scope "key": one per API key, or per group of keys (group: the policy's name of
        the key's group); without keys, one per tenant header value (a header anyone can send, so it separates
        cooperating tenants, not attackers: use keys for that); without keys or tenant header (open access),
        one for all, as a single-tenant server has. scope "shared": every request shares, unless it sends a salt
        of its own."""
        if scope == "shared":
            owner = ""
        elif group:
            owner = f"group\0{group}"
        else:
            owner = f"key\0{key_id}" if key_id else f"tenant\0{tenant or ''}"
        if not owner and not client_salt:
            return ""
        text = f"{owner}\1{client_salt}".encode("utf-8", "surrogatepass")
        return hashlib.blake2b(text, key=self._secret, digest_size=16).hexdigest()


def kept_secret(path: Path) -> bytes:
    """The secret kept in `path` (made, 0600, on first use). A file that is not exactly one secret, or that others
    may read, is replaced by a new one (logged): the salts change once, and the stored prefixes of the old ones
    are never hit again (they age out of their tier)."""
    path = Path(path)
    try:
        info = path.stat()
        secret = path.read_bytes()
        if len(secret) == SECRET_BYTES and not info.st_mode & 0o077:
            return secret
        log.warning("cache salt: %s is not a private %d-byte secret; a new one replaces it", path, SECRET_BYTES)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = secrets.token_bytes(SECRET_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return secret


def secret_file(config) -> Path | None:
    """Where the salt's secret is kept: beside the workers' disk tier when it is on (its prefixes outlive a
    restart, and must keep their salts), else nowhere (a fresh secret each start)."""
    if not config.kv_disk_bytes:
        return None
    return (Path(config.kv_disk_dir) if config.kv_disk_dir else cache_root() / "kv") / "cache-salt.secret"
