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
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
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


cdef struct Layout:
    int magic, version
    Py_ssize_t hsize
    int64_t max_record, max_props, max_body
    Py_ssize_t crc_from, at_flags, at_length, at_crc, at_due, at_id, at_topic, at_tags, at_keys, at_props, at_body


cdef Layout _layout(tuple layout):
    """The layout tuple `scan` and `gather` take, as a struct (see `scan`)."""
    cdef Layout L
    L.magic, L.version, L.hsize = layout[0], layout[1], layout[2]
    L.max_record, L.max_props, L.max_body = layout[3], layout[4], layout[5]
    L.crc_from, L.at_flags, L.at_length, L.at_crc, L.at_due = layout[6], layout[7], layout[8], layout[9], layout[10]
    L.at_id, L.at_topic, L.at_tags, L.at_keys = layout[11], layout[12], layout[13], layout[14]
    L.at_props, L.at_body = layout[15], layout[16]
    return L


cdef int _verdict(const uint8_t[::1] view, object mv, Py_ssize_t o, bint with_due, int64_t due, bint with_len,
                  int64_t expected_len, bint verify_crc, object crc32c, Layout* L) except -1:
    """One record's verdict at `o`: BAD, GOOD or FIELDS (see the module docstring)."""
    cdef Py_ssize_t size = view.shape[0], hsize = L.hsize, p
    cdef int64_t length, id_len, topic_len, tags_len, keys_len, props_len, body_len
    cdef int verdict, keys, props
    if o < 0 or o + hsize > size:
        return BAD
    if view[o] != L.magic or view[o + 1] != L.version or _u16(view, o + L.at_flags) != 0:
        return BAD
    length = _u32(view, o + L.at_length)
    if length < hsize or length > L.max_record or (with_len and length != expected_len) or o + length > size:
        return BAD
    if verify_crc and <uint32_t>crc32c(mv[o + L.crc_from:o + length]) != _u32(view, o + L.at_crc):
        return BAD
    id_len = _u16(view, o + L.at_id)
    topic_len = _u16(view, o + L.at_topic)
    tags_len = _u16(view, o + L.at_tags)
    keys_len = _u16(view, o + L.at_keys)
    props_len = _u32(view, o + L.at_props)
    body_len = _u32(view, o + L.at_body)
    if hsize + id_len + topic_len + tags_len + keys_len + props_len + body_len != length:
        return BAD
    if props_len > L.max_props or body_len > L.max_body:
        return BAD
    p = o + hsize
    verdict = GOOD if _ascii(view, p, id_len + topic_len + tags_len) else FIELDS
    p += id_len + topic_len + tags_len
    keys = _walk(view, p, keys_len, 1)  # an empty field walks to GOOD at once
    props = _walk(view, p + keys_len, props_len, 2)
    if keys == BAD or props == BAD:
        return BAD
    if keys == FIELDS or props == FIELDS:
        verdict = FIELDS
    if with_due and _i64(view, o + L.at_due) != due:
        return BAD
    return verdict


def scan(object mv, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] due_ms,
         const int64_t[::1] lengths, bint verify_crc, object crc32c, tuple layout,
         uint8_t[:, ::1] headers, uint8_t[::1] verdicts):
    """Check the records at `offsets` of `buf` (`mv`: the same bytes as a memoryview, for `crc32c`); for each row write its verdict and, unless BAD, its
    header bytes into `headers`. `due_ms` and `lengths` may be empty (not known). `layout`: magic,
    version, header size, max record, max properties, max body, the CRC's first covered byte, then
    the offsets of flags, length, crc, due_ms and the six field lengths in the header."""
    cdef Layout L = _layout(layout)
    cdef Py_ssize_t n = offsets.shape[0], i, o
    cdef bint with_due = due_ms.shape[0] > 0, with_len = lengths.shape[0] > 0
    cdef int verdict
    for i in range(n):
        o = offsets[i]
        verdict = _verdict(buf, mv, o, with_due, due_ms[i] if with_due else 0, with_len,
                           lengths[i] if with_len else 0, verify_crc, crc32c, &L)
        verdicts[i] = verdict
        if verdict != BAD:
            memcpy(&headers[i, 0], &buf[o], L.hsize)


def gather(object mv, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] due_ms,
           object crc32c, tuple layout, uint8_t[:, ::1] headers, int64_t[::1] starts):
    """The records at `offsets` of `buf` copied out one after another, when every one is GOOD as
    `scan` decides it (CRC32C checked, `due_ms` the index's, or empty): their bytes, with each row's
    header written into `headers` and where it starts in the bytes into `starts`. None as soon as
    one row is not GOOD: the caller's general path then decides (and names) what is wrong."""
    cdef Layout L = _layout(layout)
    cdef Py_ssize_t n = offsets.shape[0], i, o
    cdef bint with_due = due_ms.shape[0] > 0
    cdef int64_t total = 0, length
    cdef char* at
    for i in range(n):
        o = offsets[i]
        if _verdict(buf, mv, o, with_due, due_ms[i] if with_due else 0, False, 0, True, crc32c, &L) != GOOD:
            return None
        memcpy(&headers[i, 0], &buf[o], L.hsize)
        starts[i] = total
        total += _u32(buf, o + L.at_length)
    out = PyBytes_FromStringAndSize(<char*>NULL, total)
    at = PyBytes_AS_STRING(out)
    for i in range(n):
        length = (starts[i + 1] if i + 1 < n else total) - starts[i]
        memcpy(at + starts[i], &buf[offsets[i]], length)
    return out
