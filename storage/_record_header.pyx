# cython: language_level=3
"""The compiled record header (`storage/_record_header.pxd`) held to `storage.record` at import:
a layout changed in one place and not the other stops here, not in a record on disk."""
from libc.stdint cimport int64_t, uint8_t, uint64_t

from storage.record import HEADER, MAGIC, VERSION, _CRC_FROM

from storage._record_header cimport (RECORD_CRC_AT, RECORD_CRC_FROM, RECORD_HEADER_SIZE, RECORD_MAGIC,
                                     RECORD_VERSION, write_record_crc, write_record_header)

if (HEADER.format != "<BBHIIqqHHHHII" or HEADER.size != RECORD_HEADER_SIZE or MAGIC != RECORD_MAGIC
        or VERSION != RECORD_VERSION or _CRC_FROM != RECORD_CRC_FROM or RECORD_CRC_AT + 4 != RECORD_CRC_FROM):
    raise RuntimeError(f"storage.record's header is {HEADER.format!r} (magic {MAGIC:#x}, version {VERSION}); "
                       "storage/_record_header.pxd writes <BBHIIqqHHHHII (magic 0xa7, version 1): change both")


def header(uint64_t length, int64_t due_ms, int64_t enqueue_ms, uint64_t id_len, uint64_t topic_len,
           uint64_t tags_len, uint64_t keys_len, uint64_t props_len, uint64_t body_len, unsigned int crc) -> bytes:
    """The header the compiled writers write for these fields (for tests against `HEADER.pack`)."""
    cdef uint8_t out[RECORD_HEADER_SIZE]
    write_record_header(out, length, due_ms, enqueue_ms, id_len, topic_len, tags_len, keys_len, props_len,
                        body_len)
    write_record_crc(out, crc)
    return bytes(out[:RECORD_HEADER_SIZE])
