"""Typed errors of coordination: callers branch on the class, never on messages."""
from __future__ import annotations

__all__ = ["CoordinationError", "LocalZooKeeperError"]


class CoordinationError(Exception):
    """Base class of every error raised by the coordination package (leases, watermarks)."""


class LocalZooKeeperError(CoordinationError):
    """The local ZooKeeper (tests, demo) could not be downloaded, started or stopped."""
