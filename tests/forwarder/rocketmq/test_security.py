"""TLS settings the wire client cannot use are refused when they are made, naming the file and what to do."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from forwarder.rocketmq.security import ClientSecurity
from tests.forwarder.rocketmq._ca_file import make_ca_file
from timewheel.errors import ConfigError


def _unusable(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "nowhere" / "ca.pem"
    if kind == "directory":
        return tmp_path
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    return path


@pytest.mark.parametrize("kind, why", [("missing", "No such file or directory"), ("directory", "directory"),
                                       ("not-pem", "no certificate")])
def test_a_ca_file_that_cannot_be_used_is_refused_when_the_settings_are_made(tmp_path: Path, kind: str,
                                                                             why: str) -> None:
    """Refused before any connection is tried, naming the key, the file and what to put there: not
    a bare '[Errno 2] No such file or directory' from the first connection attempt."""
    path = _unusable(tmp_path, kind)
    with pytest.raises(ConfigError) as caught:
        ClientSecurity(tls=True, ca_file=str(path))
    text = str(caught.value)
    assert "rocketmq.tls_ca_file" in text and repr(str(path)) in text and "PEM file of the CA" in text
    assert why.lower() in text.lower()


def test_settings_with_a_usable_ca_file_pickle_and_build_their_context_again(tmp_path: Path) -> None:
    """A replay sender's settings travel to Spark executors pickled: the TLS context stays behind and
    the copy builds its own."""
    security = ClientSecurity(tls=True, ca_file=str(make_ca_file(tmp_path)))
    built = security.context()
    copy = pickle.loads(pickle.dumps(security))
    assert copy == security and built is not None
    ctx = copy.context()
    assert ctx is not None and ctx is not built and ctx.get_ca_certs()
