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

The rows it takes for a batch in a row are written into one buffer, handed to the batch as one
part when the batch changes or the loop stops: no Python object per row but its id (a send's cold
cost grows with every object and call it touches: bench/RESULTS_HOTPATHS.md, run 11).
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy

cdef enum:
    MAX_PAIRS = 64  # more properties of its own than this: the Python pass decides
    MAX_KEYS = 64  # more keys than this: the Python pass decides
    HEAD = 20  # a message's size, three zeros and its body's length (`codec.encode_message`)


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


cdef struct Buffer:
    uint8_t* data
    Py_ssize_t size
    Py_ssize_t cap


cdef int _reserve(Buffer* buf, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap = buf.cap
    cdef uint8_t* grown
    if buf.size + more <= cap:
        return 0
    if cap < 4096:
        cap = 4096
    while cap < buf.size + more:
        cap *= 2
    grown = <uint8_t*>realloc(buf.data, cap)
    if grown == NULL:
        raise MemoryError()
    buf.data = grown
    buf.cap = cap
    return 0


cdef inline uint8_t* _put(uint8_t* o, const void* src, Py_ssize_t n) noexcept nogil:
    memcpy(o, src, n)
    return o + n


cdef object _flush(object b, Buffer* buf, Py_ssize_t size):
    """The rows written for batch `b` become one of its parts; its size is `size`."""
    if b is not None and buf.size:
        b.parts.append(PyBytes_FromStringAndSize(<const char*>buf.data, buf.size))
        b.size = size
    buf.size = 0
    return None


def cut(bytes data, const int64_t[::1] start, const uint8_t[:, ::1] header, tuple layout,
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
    cdef Py_ssize_t s, a, t, g, k, pp, il, tl, gl, kl, pl, bl, p, end, ln, vl, size, w, x, npairs, nkeys
    cdef Py_ssize_t own_len, keys_len, plen, due_len, uid_len, cur_size = 0, cur_count = 0
    cdef int64_t due
    cdef char due_text[24]
    cdef Py_ssize_t pair_name[MAX_PAIRS]
    cdef Py_ssize_t pair_name_len[MAX_PAIRS]
    cdef Py_ssize_t pair_value[MAX_PAIRS]
    cdef Py_ssize_t pair_value_len[MAX_PAIRS]
    cdef Py_ssize_t key_at[MAX_KEYS]
    cdef Py_ssize_t key_len[MAX_KEYS]
    cdef bint ok
    cdef bytes mid, name, before, after, cur_topic = None
    cdef str uid
    cdef const char* uid_text
    cdef object b, cur = None
    cdef uint8_t* o
    cdef Buffer buf
    buf.data = NULL
    buf.size = buf.cap = 0
    try:
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
            nkeys = keys_len = 0
            if kl:
                if _u16(d + k) == kl - 2:
                    key_at[0] = k + 2
                    key_len[0] = kl - 2
                    nkeys = 1
                else:
                    p = k
                    end = k + kl
                    ok = True
                    while p < end:
                        if nkeys >= MAX_KEYS or p + 2 > end:
                            ok = False
                            break
                        ln = _u16(d + p)
                        if p + 2 + ln > end:
                            ok = False
                            break
                        key_at[nkeys] = p + 2
                        key_len[nkeys] = ln
                        nkeys += 1
                        p += 2 + ln
                    if not ok:
                        break
                ok = True
                for w in range(nkeys):
                    if not _separator_free(d + key_at[w], key_len[w]):
                        ok = False
                        break
                    keys_len += key_len[w]
                if not ok:
                    break
                keys_len += nkeys - 1  # the spaces between them
                if not keys_len:
                    nkeys = 0  # one empty key: no KEYS at all, as the general path joins it
            # ---- its own properties: name \x01 value \x02 each, in their stored order
            own_len = npairs = 0
            if pl:
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
                for w in range(npairs):
                    name = PyBytes_FromStringAndSize(<const char*>d + pair_name[w], pair_name_len[w])
                    if name in clash:
                        ok = False
                        break
                    for x in range(w):
                        if pair_name_len[x] == pair_name_len[w] and \
                                memcmp(d + pair_name[x], d + pair_name[w], pair_name_len[w]) == 0:
                            ok = False
                            break
                    if not ok:
                        break
                    own_len += pair_name_len[w] + pair_value_len[w] + 2
                if not ok:
                    break
            # ---- the id, then the properties' and the message's length, before writing anything
            mid = PyBytes_FromStringAndSize(<const char*>d + a, il)
            uid = derived_id(mid, due)
            uid_text = PyUnicode_AsUTF8AndSize(uid, &uid_len)
            due_len = snprintf(due_text, sizeof(due_text), "%lld", <long long>due)  # str(due)
            before, after = (a_own, b_own) if pl else (a_plain, b_plain)
            plen = own_len + PyBytes_GET_SIZE(before) + il + PyBytes_GET_SIZE(due_name) + due_len \
                + PyBytes_GET_SIZE(after) + uid_len + 1
            if gl:
                plen += PyBytes_GET_SIZE(tags_name) + gl
            if nkeys:
                plen += PyBytes_GET_SIZE(keys_name) + keys_len
            if plen > max_props:
                break
            size = 22 + bl + plen
            if size > max_message:
                break
            # ---- its batch: the one being written while the topic and the limits allow
            if cur is None or tl != PyBytes_GET_SIZE(cur_topic) or memcmp(d + t, PyBytes_AS_STRING(cur_topic), tl) != 0 \
                    or cur_count >= max_count or cur_size + size > max_bytes:
                _flush(cur, &buf, cur_size)
                cur_topic = PyBytes_FromStringAndSize(<const char*>d + t, tl)
                b = open_batch.get(cur_topic)
                if b is None or len(b.index) >= max_count or b.size + size > max_bytes:
                    b = open_batch[cur_topic] = new_batch(cur_topic)
                    batches.append(b)
                cur = b
                cur_size = b.size
                cur_count = len(b.index)
            # ---- the message: head, body, the properties' length and the properties
            _reserve(&buf, size)
            o = buf.data + buf.size
            _be32(o, size)
            _be32(o + 4, 0)
            _be32(o + 8, 0)
            _be32(o + 12, 0)
            _be32(o + 16, bl)
            o = _put(o + HEAD, d + pp + pl, bl)
            o[0] = (plen >> 8) & 0xFF
            o[1] = plen & 0xFF
            o += 2
            for w in range(npairs):
                o = _put(o, d + pair_name[w], pair_name_len[w])
                o[0] = 1
                o = _put(o + 1, d + pair_value[w], pair_value_len[w])
                o[0] = 2
                o += 1
            o = _put(o, PyBytes_AS_STRING(before), PyBytes_GET_SIZE(before))
            o = _put(o, d + a, il)
            o = _put(o, PyBytes_AS_STRING(due_name), PyBytes_GET_SIZE(due_name))
            o = _put(o, due_text, due_len)
            if gl:
                o = _put(o, PyBytes_AS_STRING(tags_name), PyBytes_GET_SIZE(tags_name))
                o = _put(o, d + g, gl)
            if nkeys:
                o = _put(o, PyBytes_AS_STRING(keys_name), PyBytes_GET_SIZE(keys_name))
                for w in range(nkeys):
                    if w:
                        o[0] = 32  # ' '
                        o += 1
                    o = _put(o, d + key_at[w], key_len[w])
            o = _put(o, PyBytes_AS_STRING(after), PyBytes_GET_SIZE(after))
            o = _put(o, uid_text, uid_len)
            o[0] = 2
            buf.size += size
            cur_size += size
            cur_count += 1
            ids.append(uid)
            cur.index.append(i)
            cur.ids.append(uid)
            i += 1
        return i
    finally:
        try:
            _flush(cur, &buf, cur_size)  # what was written is in its batch, even if a row raised
        finally:
            free(buf.data)
