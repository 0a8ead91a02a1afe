"""Types of the compiled scan (storage/_record_scan.pyx)."""
from collections.abc import Callable

import numpy as np

def scan(mv: memoryview, buf: np.ndarray, offsets: np.ndarray, due_ms: np.ndarray, lengths: np.ndarray,
         verify_crc: bool, crc32c: Callable[[memoryview], int], layout: tuple[int, ...], headers: np.ndarray,
         verdicts: np.ndarray) -> None: ...

def gather(mv: memoryview, buf: memoryview | np.ndarray, offsets: np.ndarray, due_ms: np.ndarray,
           crc32c: Callable[[memoryview], int], layout: tuple[int, ...], headers: np.ndarray,
           starts: np.ndarray) -> bytes | None: ...
