"""TLS for a local RocketMQ: a self-signed certificate made on the fly, and the JVM flags that turn TLS on.

RocketMQ reads its TLS settings from system properties and a properties file (`TlsSystemConfig`):
`tls.server.mode` (disabled | permissive | enforcing: the last refuses plain connections),
`tls.enable` (the process's own clients, e.g. a broker registering with its NameServer, use TLS),
and `tls.config.file` naming a file with `tls.test.mode.enable` (true: a throw-away certificate
made at each start), `tls.server.certPath` and `tls.server.keyPath` (PEM, the key in PKCS#8).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from forwarder.errors import LocalRocketMQError

__all__ = ["TLS_MODES", "tls_jvm_flags"]

#: what `tls.server.mode` accepts
TLS_MODES = ("permissive", "enforcing")


def _make_certificate(cert: Path, key: Path) -> None:
    """A self-signed certificate for 127.0.0.1 and localhost, valid ten years, with its key unencrypted."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise LocalRocketMQError("openssl is not on PATH: install it (e.g. `apt-get install openssl`) to make the "
                                 "local broker's TLS certificate")
    cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "3650",
           "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
           "-keyout", str(key), "-out", str(cert)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0 or not cert.is_file() or not key.is_file():
        raise LocalRocketMQError(f"openssl could not make a self-signed certificate: {proc.stderr.strip()[-500:]}")
    if b"BEGIN PRIVATE KEY" not in key.read_bytes():  # Netty reads PKCS#8 only; old openssl writes PKCS#1
        subprocess.run([openssl, "pkcs8", "-topk8", "-nocrypt", "-in", str(key), "-out", str(key) + ".p8"],
                       capture_output=True, timeout=60, check=True)
        Path(str(key) + ".p8").replace(key)


def tls_jvm_flags(run: Path, mode: str = "enforcing") -> list[str]:
    """Make (once per run directory) `tls/cert.pem`, `tls/key.pem` and `tls/tls.properties` under `run`;
    the JVM flags that start a NameServer or broker with TLS in `mode` on them."""
    if mode not in TLS_MODES:
        raise LocalRocketMQError(f"TLS mode {mode!r} is not one of {', '.join(TLS_MODES)}")
    folder = run / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, props = folder / "cert.pem", folder / "key.pem", folder / "tls.properties"
    if not (cert.is_file() and key.is_file()):
        _make_certificate(cert, key)
    props.write_text("tls.test.mode.enable=false\n"
                     f"tls.server.certPath={cert}\n"
                     f"tls.server.keyPath={key}\n"
                     "tls.server.need.client.auth=none\n"
                     "tls.server.authClient=false\n"
                     "tls.client.authServer=false\n")
    # given after the common flags: the last -D of a name wins
    return [f"-Dtls.server.mode={mode}", "-Dtls.enable=true", f"-Dtls.config.file={props}"]
