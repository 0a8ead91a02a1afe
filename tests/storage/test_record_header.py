"""The compiled record header (storage/_record_header.pxd) writes storage.record's layout."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from storage.record import HEADER, MAGIC, VERSION

from storage._record_header import header as _header

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=500)
@given(u32, i64, i64, u16, u16, u16, u16, u32, u32, u32)
def test_the_compiled_header_is_the_python_one(length: int, due: int, enqueue: int, il: int, tl: int, gl: int,
                                               kl: int, pl: int, bl: int, crc: int) -> None:
    """Every field at its limits and between them, byte for byte as `HEADER.pack`."""
    assert _header(length, due, enqueue, il, tl, gl, kl, pl, bl, crc) == HEADER.pack(
        MAGIC, VERSION, 0, length, crc, due, enqueue, il, tl, gl, kl, pl, bl)
