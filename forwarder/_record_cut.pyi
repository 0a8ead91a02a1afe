"""Types of the compiled loop of `record_batches.cut_records` (forwarder/_record_cut.pyx)."""
from collections.abc import Callable
from typing import Any

import numpy as np

def cut(data: bytes, start: np.ndarray, header: np.ndarray, layout: tuple[int, ...], i: int,
        derived_id: Callable[[bytes, int], str], pieces: tuple[bytes, ...], clash: frozenset[bytes], max_props: int,
        max_message: int, max_count: int, max_bytes: int, open_batch: dict[bytes, Any], batches: list[Any],
        new_batch: Callable[[bytes], Any], ids: list[str]) -> int: ...
