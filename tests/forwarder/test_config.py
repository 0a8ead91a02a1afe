"""`[rocketmq]` settings that cannot work are refused when loaded, naming the key and what to do."""
from __future__ import annotations

from pathlib import Path

import pytest

from forwarder.config import RocketMQConfig
from tests.forwarder.rocketmq._ca_file import make_ca_file
from timewheel.errors import ConfigError


@pytest.mark.parametrize("content, why", [(None, "a directory"), ("", "no certificate"),
                                          ("-----BEGIN CERTIFICATE-----\n", "no certificate")])
def test_a_tls_ca_file_that_is_there_but_not_a_pem_of_cas_is_refused_at_load(tmp_path: Path, content: str | None,
                                                                             why: str) -> None:
    """Not only a missing file: one that is a directory or holds no certificate would otherwise pass,
    and fail at the first connection as if the brokers were down."""
    path = tmp_path / "ca.pem"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        RocketMQConfig(tls=True, tls_ca_file=str(path))
    text = str(caught.value)
    assert f"rocketmq.tls_ca_file = {str(path)!r} is invalid" in text and "PEM file of the CA" in text
    assert why in text.lower()


def test_a_tls_ca_file_of_certificates_loads(tmp_path: Path) -> None:
    cfg = RocketMQConfig(tls=True, tls_ca_file=str(make_ca_file(tmp_path)))
    security = cfg.security()
    assert security is not None and security.context() is not None


@pytest.mark.parametrize("content, why", [(None, "no such file"), ("", "holds no secret"), ("\nlater\n", "holds no secret"),
                                          ("dir", "is a directory"), (b"\xff\xfe", "not utf-8")])
def test_a_secret_key_file_that_gives_no_secret_is_refused_at_load(tmp_path: Path, content: str | bytes | None,
                                                                   why: str) -> None:
    """Refused where the settings are made, naming the key and the file: not met in the middle of the
    start, nor sent as an empty secret that every broker refuses."""
    path = tmp_path / "secret"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        RocketMQConfig(access_key="engine", secret_key_file=str(path))
    text = str(caught.value)
    assert f"rocketmq.secret_key_file = {str(path)!r}" in text and "first line is the secret key" in text
    assert why in text.lower()


def test_the_secret_is_the_first_line_of_the_secret_key_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  s3cret  \nignored\n")
    security = RocketMQConfig(access_key="engine", secret_key_file=str(path)).security()
    assert security is not None and security.credentials is not None
    assert (security.credentials.access_key, security.credentials.secret_key) == ("engine", "s3cret")
