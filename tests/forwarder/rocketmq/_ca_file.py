"""A CA file a TLS client can load, for the tests of TLS settings."""
from __future__ import annotations

import subprocess
from pathlib import Path


def make_ca_file(folder: Path) -> Path:
    """A self-signed certificate in PEM under `folder`: a CA file a TLS client can load."""
    key, cert = folder / "ca-key.pem", folder / "ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=timewheel-test-ca"],
                   check=True, capture_output=True, timeout=60)
    return cert
