"""RocketMQ's ACL request signature (AccessKey/SecretKey), as its remoting clients compute it.

A signed request carries `AccessKey` (and `SecurityToken` when there is one) among its header's
ext fields, and `Signature`: Base64 of HMAC-SHA1, keyed by the SecretKey, over the values of every
ext field (AccessKey included, Signature excluded) in the order of their names, followed by the
request body. Names are ordered as Java's `TreeMap<String, ...>` orders them (UTF-16 code units).
The broker recomputes it from the same fields: a field added after signing breaks the signature.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

ACCESS_KEY = "AccessKey"
SECRET_KEY_FIELD = "SecretKey"  # never sent: named here so it is never put among the fields
SECURITY_TOKEN = "SecurityToken"
SIGNATURE = "Signature"


@dataclass(frozen=True)
class Credentials:
    """An ACL user's keys; `secret_key` is never shown in a repr or a log."""

    access_key: str
    secret_key: str = field(repr=False)
    security_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.access_key or not self.secret_key:
            raise ValueError("ACL credentials need a non-empty access key and secret key")


def _java_order(name: str) -> bytes:
    return name.encode("utf-16-be", "surrogatepass")


def sign(ext_fields: Mapping[str, str], body: bytes, credentials: Credentials) -> dict[str, str]:
    """The ext fields with AccessKey, SecurityToken (if any) and the Signature added."""
    fields = {k: v for k, v in ext_fields.items() if k != SIGNATURE}
    fields[ACCESS_KEY] = credentials.access_key
    if credentials.security_token is not None:
        fields[SECURITY_TOKEN] = credentials.security_token
    content = "".join(fields[k] for k in sorted(fields, key=_java_order)).encode("utf-8") + (body or b"")
    digest = hmac.new(credentials.secret_key.encode("utf-8"), content, hashlib.sha1).digest()
    fields[SIGNATURE] = base64.b64encode(digest).decode("ascii")
    return fields


__all__ = ["ACCESS_KEY", "Credentials", "SECURITY_TOKEN", "SIGNATURE", "sign"]
