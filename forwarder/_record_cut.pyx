# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled loop of `forwarder.record_batches.cut_records`: the plainest stored records walked
in C into their send batches.

It takes a row when it has an id, no byte 0x00-0x02 in its id, topic, tags or keys, properties of
its own (if any) that the one pass may carry (no name in `clash`, none repeated, no separator), and
fits the properties' and the message's limits; at the first row it is not sure of, it stops and says
which, and the Python pass (the reference) takes that row, then hands back. The property pieces
come from the caller (`record_batches._pieces`, the same as its templates) and the id from
`codec.derived_id` itself: what a row becomes is what the Python pass makes of it, byte for byte
(tests/forwarder/test_record_batches.py holds both to the general path).
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

cdef enum:
    MAX_PAIRS = 64  # more properties of its own than this: the Python pass decides


cdef inline Py_ssize_t _u16(const uint8_t* b) noexcept nogil:
    return b[0] | (b[1] << 8)


cdef inline uint32_t _u32(const uint8_t* b) noexcept nogil:
    return <uint32_t>b[0] | (<uint32_t>b[1] << 8) | (<uint32_t>b[2] << 16) | (<uint32_t>b[3] << 24)


cdef inline int64_t _i64(const uint8_t* b) noexcept nogil:
    cdef int64_t v
    memcpy(&v, b, 8)  # little-endian: the header is
    return v


cdef inline bint _separator_free(const uint8_t* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if b[i] <= 2:
            return False
    return True


cdef inline void _be32(uint8_t* out, Py_ssize_t v) noexcept nogil:
    out[0] = (v >> 24) & 0xFF
    out[1] = (v >> 16) & 0xFF
    out[2] = (v >> 8) & 0xFF
    out[3] = v & 0xFF


def cut(bytes data, object mv, const int64_t[::1] start, const uint8_t[:, ::1] header, tuple layout,
        Py_ssize_t i, object derived_id, tuple pieces, frozenset clash, Py_ssize_t max_props,
        Py_ssize_t max_message, Py_ssize_t max_count, Py_ssize_t max_bytes, dict open_batch, list batches,
        object new_batch, list ids):
    """Cut rows from `i` on while they are plain; return the first row not taken (or the count).

    `layout`: the header's size and the offsets in it of due_ms and the six field lengths;
    `pieces`: the properties around the row's own parts, for a row without properties of its own
    and with (before the id, after the keys), then the id's, due time's, tags' and keys' names."""
    cdef Py_ssize_t hsize = layout[0], at_due = layout[1], at_id = layout[2], at_topic = layout[3]
    cdef Py_ssize_t at_tags = layout[4], at_keys = layout[5], at_props = layout[6], at_body = layout[7]
    cdef bytes a_plain = pieces[0], b_plain = pieces[1], a_own = pieces[2], b_own = pieces[3]
    cdef bytes due_name = pieces[4], tags_name = pieces[5], keys_name = pieces[6]
    cdef const uint8_t* d = <const uint8_t*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = start.shape[0]
    cdef Py_ssize_t s, a, t, g, k, pp, il, tl, gl, kl, pl, bl, at, p, end, ln, vl, size, w, x, npairs, plen
    cdef int64_t due
    cdef Py_ssize_t pair_name[MAX_PAIRS]
    cdef Py_ssize_t pair_name_len[MAX_PAIRS]
    cdef Py_ssize_t pair_value[MAX_PAIRS]
    cdef Py_ssize_t pair_value_len[MAX_PAIRS]
    cdef bint ok
    cdef bytes mid, tkey, own, keys, props, name, head, tail
    cdef str uid
    cdef list parts
    cdef object b
    cdef uint8_t* o
    while i < n:
        s = start[i]
        due = _i64(&header[i, at_due])
        il = _u16(&header[i, at_id])
        tl = _u16(&header[i, at_topic])
        gl = _u16(&header[i, at_tags])
        kl = _u16(&header[i, at_keys])
        pl = _u32(&header[i, at_props])
        bl = _u32(&header[i, at_body])
        if il == 0:
            break  # a fresh id: the Python pass hands them out in order
        a = s + hsize
        t = a + il
        g = t + tl
        k = g + gl
        pp = k + kl
        if not _separator_free(d + a, k - a):
            break
        # ---- the keys: one as it is stored, several joined by spaces (as `_joined_keys`)
        keys = b""
        if kl:
            if _u16(d + k) == kl - 2:
                keys = PyBytes_FromStringAndSize(<const char*>d + k + 2, kl - 2)
            else:
                parts = []
                p = k
                end = k + kl
                ok = True
                while p < end:
                    if p + 2 > end:
                        ok = False
                        break
                    ln = _u16(d + p)
                    if p + 2 + ln > end:
                        ok = False
                        break
                    parts.append(PyBytes_FromStringAndSize(<const char*>d + p + 2, ln))
                    p += 2 + ln
                if not ok:
                    break
                keys = b" ".join(parts)
            if not _separator_free(<const uint8_t*>PyBytes_AS_STRING(keys), PyBytes_GET_SIZE(keys)):
                break
        # ---- its own properties: name \x01 value \x02 each, in their stored order
        own = b""
        if pl:
            npairs = 0
            p = pp
            end = pp + pl
            ok = True
            while p < end:
                if npairs >= MAX_PAIRS or p + 2 > end:
                    ok = False
                    break
                ln = _u16(d + p)
                if p + 2 + ln + 2 > end:
                    ok = False
                    break
                vl = _u16(d + p + 2 + ln)
                if p + 4 + ln + vl > end or not _separator_free(d + p + 2, ln) \
                        or not _separator_free(d + p + 4 + ln, vl):
                    ok = False
                    break
                pair_name[npairs] = p + 2
                pair_name_len[npairs] = ln
                pair_value[npairs] = p + 4 + ln
                pair_value_len[npairs] = vl
                npairs += 1
                p += 4 + ln + vl
            if not ok:
                break
            plen = 0
            for w in range(npairs):
                name = PyBytes_FromStringAndSize(<const char*>d + pair_name[w], pair_name_len[w])
                if name in clash:
                    ok = False
                    break
                for x in range(w):
                    if pair_name_len[x] == pair_name_len[w] and \
                            PyBytes_FromStringAndSize(<const char*>d + pair_name[x], pair_name_len[x]) == name:
                        ok = False
                        break
                if not ok:
                    break
                plen += pair_name_len[w] + pair_value_len[w] + 2
            if not ok:
                break
            own = PyBytes_FromStringAndSize(NULL, plen)
            o = <uint8_t*>PyBytes_AS_STRING(own)
            for w in range(npairs):
                memcpy(o, d + pair_name[w], pair_name_len[w])
                o += pair_name_len[w]
                o[0] = 1
                o += 1
                memcpy(o, d + pair_value[w], pair_value_len[w])
                o += pair_value_len[w]
                o[0] = 2
                o += 1
        # ---- the properties, the id and the message
        mid = PyBytes_FromStringAndSize(<const char*>d + a, il)
        uid = derived_id(mid, due)
        parts = [own, a_own] if pl else [a_plain]
        parts += [mid, due_name, str(due).encode()]
        if gl:
            parts += [tags_name, PyBytes_FromStringAndSize(<const char*>d + g, gl)]
        if PyBytes_GET_SIZE(keys):
            parts += [keys_name, keys]
        parts += [b_own if pl else b_plain, uid.encode("ascii"), b"\x02"]
        props = b"".join(parts)
        if PyBytes_GET_SIZE(props) > max_props:
            break
        size = 22 + bl + PyBytes_GET_SIZE(props)
        if size > max_message:
            break
        head = PyBytes_FromStringAndSize(NULL, 20)  # size, three zeros, body length (`codec.encode_message`)
        o = <uint8_t*>PyBytes_AS_STRING(head)
        _be32(o, size)
        _be32(o + 4, 0)
        _be32(o + 8, 0)
        _be32(o + 12, 0)
        _be32(o + 16, bl)
        tail = PyBytes_FromStringAndSize(NULL, 2 + PyBytes_GET_SIZE(props))  # their length, the properties
        o = <uint8_t*>PyBytes_AS_STRING(tail)
        o[0] = (PyBytes_GET_SIZE(props) >> 8) & 0xFF
        o[1] = PyBytes_GET_SIZE(props) & 0xFF
        memcpy(o + 2, PyBytes_AS_STRING(props), PyBytes_GET_SIZE(props))
        at = pp + pl
        tkey = PyBytes_FromStringAndSize(<const char*>d + t, tl)
        b = open_batch.get(tkey)
        if b is None or len(b.index) >= max_count or b.size + size > max_bytes:
            b = open_batch[tkey] = new_batch(tkey)
            batches.append(b)
        ids.append(uid)
        b.index.append(i)
        b.ids.append(uid)
        b.parts += (head, mv[at:at + bl], tail)
        b.size += size
        i += 1
    return i
