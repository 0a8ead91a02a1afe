"""The ACL signature matches what RocketMQ's own AclClientRPCHook computes (pinned vectors)."""
from __future__ import annotations

import pytest

from forwarder.rocketmq.acl import Credentials, sign


@pytest.mark.parametrize("fields,body,token,signature", [
    # computed by org.apache.rocketmq.acl.common.AclClientRPCHook (rocketmq-client 5.3.3) for the same request
    pytest.param({"topic": "TW_DELAY", "queueId": "3", "b": "ü"}, b"hello", None, "xm1JJhmt0smW4iLpaK55VsORbwQ=",
                 id="ext-fields-and-body"),
])
def test_signature_matches_rocketmqs_java_client(fields: dict[str, str], body: bytes, token: str | None,
                                                 signature: str) -> None:
    signed = sign(fields, body, Credentials("AK1", "SK1", token))
    assert signed["AccessKey"] == "AK1"
    assert signed["Signature"] == signature
    assert {k: signed[k] for k in fields} == fields


def test_a_previous_signature_is_not_signed_again() -> None:
    once = sign({"topic": "T"}, b"", Credentials("AK1", "SK1"))
    assert sign(once, b"", Credentials("AK1", "SK1")) == once


def test_the_secret_is_not_in_the_repr() -> None:
    assert "SK1" not in repr(Credentials("AK1", "SK1", "tok"))


def test_signatures_match_rocketmqs_java_client_on_generated_requests() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from forwarder.java_client import JavaClient

    names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12)
    values = st.text(st.characters(min_codepoint=32, max_codepoint=0xFFFF, exclude_categories=["Cs"]), max_size=30)
    cases: list[tuple[dict[str, str], bytes, str, str]] = []

    @given(st.dictionaries(names, values, max_size=8), st.binary(max_size=64), names, values.filter(bool))
    @settings(max_examples=60, suppress_health_check=list(HealthCheck), database=None)
    def collect(fields: dict[str, str], body: bytes, ak: str, sk: str) -> None:
        fields.pop("Signature", None)
        fields.pop("AccessKey", None)
        cases.append((fields, body, ak, sk))

    collect()
    java = JavaClient("127.0.0.1:1")  # signing needs no broker
    for (fields, body, ak, sk), theirs in zip(cases, java.sign(cases), strict=True):
        assert sign(fields, body, Credentials(ak, sk)) == theirs


def test_empty_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        Credentials("AK1", "")
