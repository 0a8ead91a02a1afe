"""The engine's RocketMQ side is the wire client alone: building it loads no native library."""
from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import forwarder
from forwarder import ContractLimits, RocketMQConfig, connect_rocketmq
from timewheel.app import cli, service
endpoints = connect_rocketmq(RocketMQConfig(namesrv="127.0.0.1:1"), ContractLimits(1000, 1000), lambda: 0)
endpoints.close()
print(sorted(m for m in sys.modules if m == "rocketmq" or m.startswith(("rocketmq.", "forwarder._rmq"))))
"""


def test_the_engine_path_never_loads_the_bundled_client() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_its_names_still_load_on_demand() -> None:
    import forwarder

    assert forwarder.NativeProducer.__module__ == "forwarder._rmq_native"
