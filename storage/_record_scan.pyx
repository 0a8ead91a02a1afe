# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled scan behind `storage.record_reader.check_records`: one loop over many records.

Per row it decides what the column path decides with numpy (header, bounds, CRC32C, field lengths)
and also walks the keys and properties and tests their strings for ASCII. Its verdicts per row:
BAD (`check_record` raises: the caller asks it why), GOOD, or FIELDS (header and CRC good, some
text not ASCII: `check_record`'s own `check_fields` decides, since UTF-8 is checked only there).
The layout comes from the caller (`storage.record.HEADER`, as field offsets and limits): it is
defined once. Only the magic byte and the version sit where every version of the layout keeps them,
bytes 0 and 1, so they are read there (their values still come from the caller).
tests/storage/test_record_reader.py holds this scan to the Python path's verdicts.
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

cdef enum:
    BAD = 0
    GOOD = 1
    FIELDS = 2


cdef inline uint16_t _u16(const uint8_t[::1] b, Py_ssize_t p) noexcept nogil:
    return <uint16_t>(b[p] | (b[p + 1] << 8))


cdef inline uint32_t _u32(const uint8_t[::1] b, Py_ssize_t p) noexcept nogil:
    return <uint32_t>b[p] | (<uint32_t>b[p + 1] << 8) | (<uint32_t>b[p + 2] << 16) | (<uint32_t>b[p + 3] << 24)


cdef inline int64_t _i64(const uint8_t[::1] b, Py_ssize_t p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, &b[p], 8)  # little-endian machines only: the module refuses to load elsewhere
    return v


cdef inline bint _ascii(const uint8_t[::1] b, Py_ssize_t p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(p, p + n):
        if b[i] >= 0x80:
            return False
    return True


cdef int _walk(const uint8_t[::1] b, Py_ssize_t p, Py_ssize_t n, int per_entry) noexcept nogil:
    """A keys (1) or properties (2) field: BAD if an entry runs past it, FIELDS if some string is
    not ASCII, else GOOD (the same walk as `storage.record._walk`)."""
    cdef Py_ssize_t end = p + n
    cdef Py_ssize_t ln
    cdef int k
    cdef int verdict = GOOD
    while p < end:
        if p + 2 > end:
            return BAD
        for k in range(per_entry):
            ln = _u16(b, p)
            p += 2
            if p + ln + (2 if k < per_entry - 1 else 0) > end:
                return BAD
            if verdict == GOOD and not _ascii(b, p, ln):
                verdict = FIELDS
            p += ln
    return verdict


def scan(object mv, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] due_ms,
         const int64_t[::1] lengths, bint verify_crc, object crc32c, tuple layout,
         uint8_t[:, ::1] headers, uint8_t[::1] verdicts):
    """Check the records at `offsets` of `buf` (`mv`: the same bytes as a memoryview, for `crc32c`); for each row write its verdict and, unless BAD, its
    header bytes into `headers`. `due_ms` and `lengths` may be empty (not known). `layout`: magic,
    version, header size, max record, max properties, max body, the CRC's first covered byte, then
    the offsets of flags, length, crc, due_ms and the six field lengths in the header."""
    cdef int magic = layout[0], version = layout[1]
    cdef Py_ssize_t hsize = layout[2]
    cdef int64_t max_record = layout[3], max_props = layout[4], max_body = layout[5]
    cdef Py_ssize_t crc_from = layout[6], at_flags = layout[7], at_length = layout[8], at_crc = layout[9]
    cdef Py_ssize_t at_due = layout[10], at_id = layout[11], at_topic = layout[12], at_tags = layout[13]
    cdef Py_ssize_t at_keys = layout[14], at_props = layout[15], at_body = layout[16]
    cdef Py_ssize_t n = offsets.shape[0], size = buf.shape[0]
    cdef bint with_due = due_ms.shape[0] > 0, with_len = lengths.shape[0] > 0
    cdef Py_ssize_t i, o, p
    cdef int64_t length, id_len, topic_len, tags_len, keys_len, props_len, body_len
    cdef int verdict, v
    cdef const uint8_t[::1] view = buf
    for i in range(n):
        verdicts[i] = BAD
        o = offsets[i]
        if o < 0 or o + hsize > size:
            continue
        if view[o] != magic or view[o + 1] != version or _u16(view, o + at_flags) != 0:
            continue
        length = _u32(view, o + at_length)
        if length < hsize or length > max_record or (with_len and length != lengths[i]) or o + length > size:
            continue
        if verify_crc and <uint32_t>crc32c(mv[o + crc_from:o + length]) != _u32(view, o + at_crc):
            continue
        id_len = _u16(view, o + at_id)
        topic_len = _u16(view, o + at_topic)
        tags_len = _u16(view, o + at_tags)
        keys_len = _u16(view, o + at_keys)
        props_len = _u32(view, o + at_props)
        body_len = _u32(view, o + at_body)
        if hsize + id_len + topic_len + tags_len + keys_len + props_len + body_len != length:
            continue
        if props_len > max_props or body_len > max_body:
            continue
        p = o + hsize
        verdict = GOOD if _ascii(view, p, id_len + topic_len + tags_len) else FIELDS
        p += id_len + topic_len + tags_len
        if keys_len:
            v = _walk(view, p, keys_len, 1)
            if v == BAD:
                continue
            if v == FIELDS:
                verdict = FIELDS
        p += keys_len
        if props_len:
            v = _walk(view, p, props_len, 2)
            if v == BAD:
                continue
            if v == FIELDS:
                verdict = FIELDS
        if with_due and _i64(view, o + at_due) != due_ms[i]:
            continue
        memcpy(&headers[i, 0], &view[o], hsize)
        verdicts[i] = verdict
