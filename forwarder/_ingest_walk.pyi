"""Types of the compiled loop of ingest's one pass (forwarder/_ingest_walk.pyx)."""
from collections.abc import Callable
from typing import Any

def walk(body: bytes, p: int, now: int, max_delay: int, max_body: int, names: dict[bytes, int],
         targets: dict[bytes, bytes], queue_names: dict[int, str], broker: str, limits: tuple[int, ...],
         crc32c: Callable[..., int], blobs: list[Any], ids: list[Any], dues: list[Any], lengths: list[Any],
         key_col: list[Any], queues: list[Any], offsets: list[Any], at: list[Any]) -> tuple[int, int, int]: ...
