"""Typed errors of coordination: callers branch on the class, never on messages."""
from __future__ import annotations

from kazoo.exceptions import ConnectionLoss, NoAuthError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError

from timewheel.failure_log import one_line  # kazoo's errors often carry no message: then the type alone

__all__ = ["CoordinationError", "DedupeBrokersUnpublishedError", "LeasePathDeletedError", "LocalZooKeeperError",
           "ZooKeeperFailingError", "ZooKeeperHistoryLostError", "ZooKeeperJoinError", "ZooKeeperUnreachableError",
           "one_line"]

#: what a NoAuthError means, at a replica's start as while it runs
_NO_AUTH = "NoAuthError: a znode's ACL denies this client the request"


class CoordinationError(Exception):
    """Base class of every error raised by the coordination package (leases, watermarks)."""


class LocalZooKeeperError(CoordinationError):
    """The local ZooKeeper (tests, demo) could not be downloaded, started or stopped."""


class ZooKeeperUnreachableError(CoordinationError, ConnectionError):
    """A replica's first connect to ZooKeeper did not complete in time: nothing was taken; `serve`
    reports it in one line (exit 2)."""

    def __init__(self, zookeeper: str, timeout_s: float) -> None:
        """The message names the connect string and how long the connect was given."""
        super().__init__(f"cannot reach ZooKeeper at ha.zookeeper = {zookeeper!r} within {timeout_s:.0f} s: "
                         f"start it or fix the connect string")


class ZooKeeperJoinError(CoordinationError, ConnectionError):
    """ZooKeeper failed a replica's start (its connection dropped, or it refused a request) after it
    connected: nothing was taken, the session is closed; `serve` reports it in one line (exit 2)."""

    def __init__(self, zookeeper: str, replica_id: str, shard_path: str, cause: BaseException) -> None:
        """The message names the connect string, the replica, its shard and what ZooKeeper did."""
        dropped = isinstance(cause, (ConnectionLoss, SessionExpiredError, KazooTimeoutError))
        what = "dropped the connection" if dropped else f"refused a request ({one_line(cause)})"
        act = "start it again"
        if isinstance(cause, NoAuthError):  # a start again meets the same ACL
            what = f"refused a request ({_NO_AUTH})"
            act = (f"grant this client create, delete and write on {shard_path} and the znodes above it, or set "
                   f"ha.root to a path it may write")
        super().__init__(f"ZooKeeper at ha.zookeeper = {zookeeper!r} {what} while replica {replica_id!r} joined "
                         f"shard {shard_path}: nothing was taken; {act}")


class ZooKeeperFailingError(CoordinationError):
    """Every round of a running replica has failed (ZooKeeper refusing its requests, or out of reach) for
    longer than its session timeout: it sends nothing and cannot take the lease over until a round
    succeeds. Raised by nobody: its message is the service's reason not to be ready (`/readyz`, `status`)."""

    def __init__(self, zookeeper: str, replica_id: str, shard_path: str, failing_s: float, rounds: int,
                 last: BaseException | str) -> None:
        """The message names the connect string, the replica, its shard, how long and how many rounds, the
        last failure (an error, or why no request could be made) and what to check."""
        self.failing_s, self.rounds = failing_s, rounds
        if isinstance(last, NoAuthError):
            what = _NO_AUTH
            act = (f"check the ACLs of {shard_path} and the znodes under it (getAcl in zkCli.sh) against this "
                   f"client, which connects without credentials (world:anyone, and its host's ip): grant it "
                   f"create, delete, read and write on them")
        else:
            what = one_line(last) if isinstance(last, BaseException) else last
            act = "check that it is up, reachable from this host and answering (ruok, zkCli.sh)"
        super().__init__(f"ZooKeeper at ha.zookeeper = {zookeeper!r} has failed every round of replica {replica_id!r} "
                         f"of shard {shard_path} for {failing_s:.0f} s ({rounds} rounds; the last: {what}): it sends "
                         f"nothing and cannot take the lease over; {act}. It is ready again at the first round "
                         f"that succeeds")


class DedupeBrokersUnpublishedError(CoordinationError):
    """A lease holder could not publish the brokers it learnt for `ha.dedupe_brokers_publish_timeout_s`,
    sending nothing meanwhile: it gives up, and its replica thread ends with this (the fence revoked,
    the service not ready and stopping, which hands the lease on)."""

    def __init__(self, path: str, held_s: float, timeout_s: float, why: str) -> None:
        """The message names the znode, how long sends were held, the bound, the last failure and what to do."""
        self.path, self.held_s, self.timeout_s, self.why = path, held_s, timeout_s, why
        super().__init__(f"the holder could not publish the brokers it learnt to {path} for {held_s:.0f} s "
                         f"(ha.dedupe_brokers_publish_timeout_s = {timeout_s:g}): {why}; it sent nothing meanwhile "
                         f"and gives the lease up (its messages are kept). Mend the cause: the znode's ACL, a topic "
                         f"whose brokers fill a part alone, a deposed holder still writing (docs/OPERATIONS.md)")


class ZooKeeperHistoryLostError(CoordinationError):
    """ZooKeeper's data was replaced under a running replica: it answers from before the last transaction
    this replica's client saw (an ensemble rebuilt empty, or restored from an older backup) and so refuses
    that client for good, or it took the client back in a new session without the shard's tree the replica
    joined (`lost_path`: a new ensemble already past it, another cluster's backup). Its replica thread ends
    with this (the fence revoked, the service not ready and exiting with code 3)."""

    def __init__(self, zookeeper: str, seen_zxid: int, server_zxid: int, *, lost_path: str | None = None) -> None:
        """The message names the connect string, both transaction ids and what to do; with `lost_path`, the
        znode gone, `seen_zxid` being the transaction that created the one the replica joined."""
        self.seen_zxid, self.server_zxid, self.lost_path = seen_zxid, server_zxid, lost_path
        if lost_path is None:
            what = (f"is at transaction 0x{server_zxid:x}, before 0x{seen_zxid:x} that this replica saw: its data "
                    f"was replaced (rebuilt empty or restored from a backup), and it refuses this replica's session "
                    f"for good")
        else:
            what = (f"took this replica back in a new session at transaction 0x{server_zxid:x}, but {lost_path}, "
                    f"which the replica joined (created at 0x{seen_zxid:x}), is gone or was created again: its data "
                    f"was replaced (a new ensemble, or another cluster's backup), whose epochs and watermarks are "
                    f"not those this replica kept")
        super().__init__(f"ZooKeeper at ha.zookeeper = {zookeeper!r} {what}. The replica sends nothing and stops; "
                         f"restart it (a supervisor does, on exit code 3) to join the new ZooKeeper: its messages "
                         f"are kept in its data directory (docs/HA.md)")


class LeasePathDeletedError(CoordinationError):
    """The shard's lease path (`<shard>/lease`, the parent of the replicas' lease nodes) was deleted in
    ZooKeeper, or deleted and created again, by hand or by a tool (ZooKeeper never removes it). A running
    replica that finds it so under its own session ends its thread with this (the fence revoked, the service
    not ready and exiting with code 3); a start refuses with it while the shard's watermark holds an epoch
    that lease path cannot have given (`serve` says so in one line, exit 2)."""

    def __init__(self, lease_path: str, watermark_path: str, *, watermark_epoch: int | None = None,
                 next_epoch: int | None = None) -> None:
        """The message names the lease path, the watermark znode and what to do; at a start, `watermark_epoch`
        is the watermark's and `next_epoch` the one the lease path would give next (None: it is gone)."""
        self.lease_path, self.watermark_path, self.watermark_epoch = lease_path, watermark_path, watermark_epoch
        if watermark_epoch is None:
            what = (f"{lease_path} was deleted in ZooKeeper (or deleted and created again) under this replica's "
                    f"live session, by hand or by a tool: the lease nodes went with it, and a path created again "
                    f"numbers epochs from 1 again, under those the shard's watermark and delivered messages carry. "
                    f"The replica sends nothing and stops (exit code 3), as every replica of the shard does; its "
                    f"messages are kept in its data directory")
        else:
            gives = "is gone" if next_epoch is None else f"was created again (its next epoch would be {next_epoch})"
            what = (f"{lease_path} {gives}, but {watermark_path} holds epoch {watermark_epoch}, which this lease "
                    f"path cannot have given: it was deleted under the replicas, by hand or by a tool. The replica "
                    f"does not start: its lease would carry an epoch at or below those already given")
        super().__init__(f"{what}. Once no replica of the shard runs, delete {watermark_path} if it is there (its "
                         f"epoch is the deleted lease path's), then start them again: epochs count from 1 again, and "
                         f"each data directory keeps what it recorded (docs/HA.md)")
