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
    #: skip the certificate checks (chain and host name): only for a throw-away test broker on a
    #: self-signed certificate; otherwise the server's certificate is verified against `ca_file`, or
    #: the system's CAs without one
    tls_insecure: bool = False
    ca_file: str | None = None
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    def context(self) -> ssl.SSLContext | None:
        """The TLS context connections wrap their sockets in (None without TLS); built once."""
        if not self.tls:
            return None
        if self._context is None:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.tls_insecure:
                # asked for by name: anyone on the path could answer in the broker's place
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            object.__setattr__(self, "_context", ctx)
        return self._context


__all__ = ["ClientSecurity"]
