"""The NameServer: topic routes (which broker holds which queues of a topic), with fail-over.

    GET_ROUTEINFO_BY_TOPIC request: extFields topic, acceptStandardJsonOnly. Response code 17 when
    the NameServer knows no route, else a TopicRouteData body:
      {"brokerDatas": [{"brokerName": "b", "brokerAddrs": {"0": "host:port", "1": ...}}],
       "queueDatas": [{"brokerName": "b", "writeQueueNums": 4, "perm": 6, ...}], ...}
    brokerAddrs key "0" is the master, the only one a client writes to or pulls from; perm & 2:
    writable, perm & 4: readable.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forwarder.rocketmq.connection import Connection, host_port_ok
from forwarder.rocketmq.security import ClientSecurity
from forwarder.rocketmq.errors import ConnectionFailedError, ProtocolError, RequestTimeoutError
from forwarder.rocketmq.protocol import GET_ROUTEINFO_BY_TOPIC, SUCCESS, TOPIC_NOT_EXIST, error_for_code

__all__ = ["MAX_ROUTE_QUEUES", "NameServerClient", "TopicRoute", "parse_route", "topic_route"]

#: queues a route may list in all: far above any real topic's, far below what a corrupt count
#: would take to hold (two billion of them, gigabytes)
MAX_ROUTE_QUEUES = 1 << 16
_MASTER_ID = "0"  # brokerAddrs key of a broker set's master
_PERM_WRITE = 1 << 1
_PERM_READ = 1 << 2


@dataclass(frozen=True, slots=True)
class TopicRoute:
    """The writable (or, parsed with `readable=True`, readable) queues of a topic and the master
    address of each broker holding some."""

    topic: str
    queues: tuple[tuple[str, int], ...]  # (broker name, queue id), brokers in name order
    brokers: Mapping[str, str]  # broker name -> master "host:port"
    fetched: float  # time.monotonic() of the look-up
    via_default_topic: bool = False  # no route of its own yet: sent where the broker may create it

    @classmethod
    def parse(cls, topic: str, data: Mapping[str, Any], fetched: float, *, via_default_topic: bool = False,
              max_queues: int | None = None, readable: bool = False) -> TopicRoute:
        """Build from a TopicRouteData document (only masters of writable, or readable, queue sets count)."""
        masters = {b["brokerName"]: b["brokerAddrs"][_MASTER_ID] for b in data.get("brokerDatas", ())
                   if _MASTER_ID in (b.get("brokerAddrs") or {})}
        perm, count = (_PERM_READ, "readQueueNums") if readable else (_PERM_WRITE, "writeQueueNums")
        queues: list[tuple[str, int]] = []
        brokers: dict[str, str] = {}
        for qd in sorted(data.get("queueDatas", ()), key=lambda q: q["brokerName"]):
            name = qd["brokerName"]
            if not qd.get("perm", 0) & perm or name not in masters:
                continue
            n = int(qd.get(count, 0))
            if max_queues is not None:
                n = min(n, max_queues)
            # checked before the list is built: a count is whatever the NameServer claims
            if len(queues) + n > MAX_ROUTE_QUEUES:
                raise ValueError(f"broker {name} claims {n} queues, more than a route may have ({MAX_ROUTE_QUEUES})")
            if not host_port_ok(masters[name]):
                raise ValueError(f"broker {name} is at {masters[name]!r}, not HOST:PORT")
            queues += [(name, q) for q in range(n)]
            brokers[name] = masters[name]
        return cls(topic, tuple(queues), brokers, fetched, via_default_topic)


def parse_route(topic: str, data: Mapping[str, Any], **options: Any) -> TopicRoute:
    """TopicRoute.parse, with a route document of an unexpected shape as a ProtocolError."""
    try:
        return TopicRoute.parse(topic, data, time.monotonic(), **options)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"the NameServer's route of {topic} has an unexpected shape: {e!r}") from e


class NameServerClient:
    """Asks the NameServers ("host:port", several separated by ';') in turn over one connection; thread-safe."""

    def __init__(self, namesrv: str, timeout: float, security: ClientSecurity | None = None) -> None:
        """Configure (connects lazily); ValueError if `namesrv` names no address."""
        self.security = security
        self.addrs = [a.strip() for a in namesrv.split(";") if a.strip()]
        if not self.addrs:
            raise ValueError(f"no NameServer address in {namesrv!r}")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._next = 0

    def route_document(self, topic: str) -> dict[str, Any] | None:
        """The NameServer's TopicRouteData for `topic`, or None if it has none."""
        ext = {"topic": topic, "acceptStandardJsonOnly": "true"}
        errors: list[str] = []
        with self._lock:
            for _ in range(len(self.addrs)):
                try:
                    if self._conn is None or not self._conn.alive():
                        addr = self.addrs[self._next % len(self.addrs)]
                        self._conn = Connection(addr, self.timeout, self.security)
                    resp = self._conn.request(GET_ROUTEINFO_BY_TOPIC, ext, b"", time.monotonic() + self.timeout)
                except (ConnectionFailedError, RequestTimeoutError, ProtocolError) as e:
                    errors.append(str(e))
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    self._next += 1
                    continue
                if resp.code == TOPIC_NOT_EXIST:
                    return None
                if resp.code != SUCCESS:
                    raise error_for_code(resp.code, resp.remark, f"NameServer {self._conn.addr}")
                try:
                    data: dict[str, Any] = json.loads(resp.body)
                except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
                    raise ProtocolError(f"route of {topic} from {self._conn.addr} is not JSON: {e}") from e
                return data
        raise ConnectionFailedError(f"no NameServer answered for {topic}: {'; '.join(errors)}")

    def local_ip(self) -> str | None:
        """This host's address as the NameServer sees it, while connected (None otherwise)."""
        with self._lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn.local_ip
        return None

    def close(self) -> None:
        """Close the connection (the next look-up opens another)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def topic_route(namesrv: str, topic: str, timeout: float = 5.0,
                security: ClientSecurity | None = None) -> dict[str, Any] | None:
    """The NameServer's route document of `topic` (brokerDatas, queueDatas), or None if it has none."""
    client = NameServerClient(namesrv, timeout, security)
    try:
        return client.route_document(topic)
    finally:
        client.close()
