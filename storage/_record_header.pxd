# cython: language_level=3
# The record header of `storage.record` (HEADER, "<BBHIIqqHHHHII") for compiled writers: the one
# C definition of that layout. `storage/_record_header.pyx` checks it against `storage.record` at
# import, and a writer that cimports this imports that module too (tests/storage/test_record_header.py).
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

cdef enum:
    RECORD_HEADER_SIZE = 44  # HEADER.size
    RECORD_CRC_AT = 8  # where the CRC32C goes
    RECORD_CRC_FROM = 12  # the CRC covers the record from here to its end
    RECORD_MAGIC = 0xA7
    RECORD_VERSION = 1


# little-endian unsigned integers, as the header and the keys' and properties' length prefixes
# (`storage.record.encode_fields`) hold them; each returns where the next byte goes
cdef inline uint8_t* le16(uint8_t* d, uint64_t v) noexcept nogil:
    d[0] = <uint8_t>v
    d[1] = <uint8_t>(v >> 8)
    return d + 2


cdef inline uint8_t* le32(uint8_t* d, uint64_t v) noexcept nogil:
    d[0] = <uint8_t>v
    d[1] = <uint8_t>(v >> 8)
    d[2] = <uint8_t>(v >> 16)
    d[3] = <uint8_t>(v >> 24)
    return d + 4


cdef inline uint8_t* le64(uint8_t* d, uint64_t v) noexcept nogil:
    d = le32(d, v)  # its low four bytes
    return le32(d, v >> 32)


cdef inline uint8_t* write_record_header(uint8_t* r, uint64_t length, int64_t due_ms, int64_t enqueue_ms,
                                         uint64_t id_len, uint64_t topic_len, uint64_t tags_len,
                                         uint64_t keys_len, uint64_t props_len, uint64_t body_len) noexcept nogil:
    """Write the header at `r`, its CRC field zero (`write_record_crc` fills it once the record is
    whole); returns where the id goes."""
    cdef uint8_t* d
    r[0] = RECORD_MAGIC
    r[1] = RECORD_VERSION
    d = le16(r + 2, 0)  # flags
    d = le32(d, length)
    d = le32(d, 0)  # crc
    d = le64(d, <uint64_t>due_ms)
    d = le64(d, <uint64_t>enqueue_ms)
    d = le16(d, id_len)
    d = le16(d, topic_len)
    d = le16(d, tags_len)
    d = le16(d, keys_len)
    d = le32(d, props_len)
    return le32(d, body_len)


cdef inline void write_record_crc(uint8_t* r, uint32_t crc) noexcept nogil:
    """Put the CRC32C of the record's bytes [RECORD_CRC_FROM, length) in its header."""
    le32(r + RECORD_CRC_AT, crc)
