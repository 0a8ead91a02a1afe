"""What a connection needs to reach a secured cluster: ACL credentials to sign with, TLS to wrap in."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from forwarder.rocketmq.acl import Credentials


@dataclass(frozen=True)
class ClientSecurity:
    """ACL credentials (every request signed) and/or TLS (every connection wrapped)."""

    credentials: Credentials | None = None
    tls: bool = False
    #: verify the server's certificate against `ca_file` (or the system's CAs); off for self-signed brokers
    tls_verify: bool = False
    ca_file: str | None = None
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def context(self) -> ssl.SSLContext | None:
        """The TLS context connections wrap their sockets in (None without TLS); built once."""
        if not self.tls:
            return None
        if self._context is None:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if not self.tls_verify:
                # RocketMQ brokers commonly run on self-signed certificates (as its own docs set them up)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            object.__setattr__(self, "_context", ctx)
        return self._context


__all__ = ["ClientSecurity"]
