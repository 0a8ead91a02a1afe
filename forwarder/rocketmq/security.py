"""What a connection needs to reach a secured cluster: ACL credentials to sign with, TLS to wrap in."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from forwarder.rocketmq.acl import Credentials
from timewheel.errors import ConfigError

#: what a CA file must be, as the refusals of one say it
CA_FILE_WANTED = "a readable PEM file of the CA certificates that signed the brokers' certificates"


def ca_file_problem(path: str) -> str | None:
    """Why the file at `path` cannot be the CAs a TLS client trusts (None: it can)."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ValueError) as e:
        return _why(e)
    return None


def _why(e: Exception) -> str:
    """A CA file's load error in words: missing, unreadable, a directory, no certificate in it."""
    if isinstance(e, ssl.SSLError):  # OpenSSL's own words ("PEM_LIB") alone name no file and no fix
        return f"no certificate could be read from it as PEM: OpenSSL says {e.reason or e}"
    return str(getattr(e, "strerror", None) or e).lower()


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

    def __post_init__(self) -> None:
        # built now: a CA file it cannot use is refused where the settings are made, before anything
        # connects, not met by each connection attempt as if the broker were down
        if self.tls:
            object.__setattr__(self, "_context", self._build())

    def __getstate__(self) -> dict[str, object]:
        """All but the TLS context, which does not pickle: a copy (a Spark executor's) builds its own."""
        return {**self.__dict__, "_context": None}

    def context(self) -> ssl.SSLContext | None:
        """The TLS context connections wrap their sockets in (None without TLS); built once."""
        if not self.tls:
            return None
        if self._context is None:
            object.__setattr__(self, "_context", self._build())
        return self._context

    def _build(self) -> ssl.SSLContext:
        """The TLS context of these settings; ConfigError naming a CA file that cannot be used."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"rocketmq.tls_ca_file = {self.ca_file!r} cannot be used ({_why(e)}): it must be "
                              f"{CA_FILE_WANTED}, or unset to check those against the system's CAs") from e
        if self.tls_insecure:
            # asked for by name: anyone on the path could answer in the broker's place
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


__all__ = ["CA_FILE_WANTED", "ClientSecurity", "ca_file_problem"]
