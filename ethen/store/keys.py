"""API key material: generation, parsing, salted hashing and constant-time verification (pure, no I/O).

Format: ``ethen_<key id>_<secret>``: ``key id`` is 12 lowercase hex characters (public, the lookup handle,
shown by ``ethen keys list``), ``secret`` is 43 URL-safe base64 characters (256 random bits). Only the key
id, a random 16-byte salt and ``SHA-256(salt || secret)`` are stored; the full key is shown once at creation.
A fast salted hash is enough: the secret has 256 bits of entropy, so stretching adds nothing. Verification
uses :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final, NamedTuple

__all__ = ["KEY_PREFIX", "NewKey", "ParsedKey", "digest", "generate_key", "parse_key", "verify"]

KEY_PREFIX: Final = "ethen_"
_KEY = re.compile(r"^ethen_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


class ParsedKey(NamedTuple):
    key_id: str
    secret: str


class NewKey(NamedTuple):
    key: str  # shown once, never stored
    key_id: str
    salt: bytes
    digest: bytes


def digest(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def generate_key() -> NewKey:
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    return NewKey(f"{KEY_PREFIX}{key_id}_{secret}", key_id, salt, digest(salt, secret))


def parse_key(key: str) -> ParsedKey | None:
    """The key id and secret of a well-formed store key, else ``None``."""
    m = _KEY.match(key)
    return ParsedKey(m.group(1), m.group(2)) if m else None


def verify(secret: str, salt: bytes, stored: bytes) -> bool:
    return hmac.compare_digest(digest(salt, secret), stored)
