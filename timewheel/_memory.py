"""Giving back to the operating system what a segment load's temporaries took.

Loading a segment builds arrays of tens of bytes per entry (its index, part numbers, refs, the
wheel's bucketing) that are freed once the entries sit in the wheel's 16 bytes each. glibc's
allocator keeps such freed blocks for reuse: after it frees a block it had mapped, it raises its
mapping threshold (up to 32 MiB), so the next arrays of a few MiB come from the heap, and a heap
holding a long-lived block above freed ones is not trimmed. The process then stays resident at
~80 bytes per loaded message for 16 in use. `malloc_trim(0)` hands the free pages back (every
arena's, in glibc 2.8 and later). Elsewhere than glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("timewheel.memory")

_TRIM = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _TRIM = _libc.malloc_trim
    _TRIM.argtypes = [ctypes.c_size_t]
    _TRIM.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc: its allocator is its own business
    _TRIM = None


def release_free_memory() -> None:
    """Return the allocator's free pages to the operating system (a few ms; after bulk loads only)."""
    if _TRIM is not None:
        _TRIM(0)
