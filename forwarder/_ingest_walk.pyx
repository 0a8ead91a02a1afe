# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled loop of ingest's one pass (`forwarder._ingest_pass.OnePass`): the plainest messages
of a pull answer, walked in C straight to the record bytes and the columns.

It takes a message only when every byte of its topic and properties is ASCII, none of its own
properties repeats, its target is one already checked and everything else is as the Python walk's
one pass takes it; at the first message it is not sure of, it stops and says where, and the Python
walk (the reference) decides that one message, then hands back. What it writes for a message is
what the Python walk writes, byte for byte: the record in `storage.record`'s layout (its header
through `storage/_record_header.pxd`, the layout's one C definition), written here into one new
bytes object, its CRC and the id's through `crc32c` itself (tests/forwarder/test_ingest_pass.py
holds both walks to the general path, and this one to the Python walk). Names are classified by
the caller (`forwarder._ingest_pass`), not here.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport INT64_MAX, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from storage._record_header cimport (RECORD_CRC_FROM, RECORD_HEADER_SIZE, le16, write_record_crc,
                                     write_record_header)

import storage._record_header  # noqa: F401  (its import holds the C header to storage.record's)

cdef extern from "Python.h":
    enum: PyBUF_READ
    object PyMemoryView_FromMemory(char* mem, Py_ssize_t size, int flags)
    str PyUnicode_DecodeASCII(const char* s, Py_ssize_t size, const char* errors)

cdef const char* _HEX_UPPER = b"0123456789ABCDEF"
cdef const char* _HEX_LOWER = b"0123456789abcdef"
cdef const char* _TRANSIENT = b"__RMQ.TRANSIENT."  # 16 bytes: names never carried

# what a property's name is to the walk (the caller's table maps names to these)
cdef enum:
    CARRIED = 0
    TARGET = 1
    DELIVER_AT = 2
    DELAY = 3
    START_DELIVER = 4
    UNIQ = 5
    TAGS = 6
    KEYS = 7
    NOT_CARRIED = 8
    STOP = 9  # the Python walk decides (a control property)
    UNLISTED = -1  # not in the table: carried, unless transient

cdef enum:
    MAX_PAIRS = 64  # more properties than this: the Python walk decides

cdef inline int32_t _i32(const uint8_t* b) noexcept nogil:
    return <int32_t>((<uint32_t>b[0] << 24) | (<uint32_t>b[1] << 16) | (<uint32_t>b[2] << 8) | <uint32_t>b[3])

cdef inline int16_t _i16(const uint8_t* b) noexcept nogil:
    return <int16_t>((b[0] << 8) | b[1])

cdef inline int64_t _i64(const uint8_t* b) noexcept nogil:
    cdef unsigned long long v = 0
    cdef int k
    for k in range(8):
        v = (v << 8) | b[k]
    return <int64_t>v

cdef inline bint _ascii(const uint8_t* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if b[i] >= 0x80:
            return False
    return True

cdef inline int64_t _digits(const uint8_t* b, Py_ssize_t n, int max_digits) noexcept nogil:
    """The value of 1 to `max_digits` ASCII digits, else -1."""
    cdef int64_t v = 0
    cdef Py_ssize_t i
    if n < 1 or n > max_digits:
        return -1
    for i in range(n):
        if b[i] < 48 or b[i] > 57:
            return -1
        v = v * 10 + (b[i] - 48)
    return v

cdef inline Py_ssize_t _width(int64_t v) noexcept nogil:
    """How many decimal digits `str(v)` has, for `v` >= 0."""
    cdef Py_ssize_t n = 1
    while v >= 10:
        v //= 10
        n += 1
    return n

cdef inline uint8_t* _decimal(uint8_t* d, int64_t v, Py_ssize_t width) noexcept nogil:
    """`str(v)` (`width` digits, `v` >= 0) at `d`; returns past it."""
    cdef Py_ssize_t i = width
    while i > 0:
        i -= 1
        d[i] = <uint8_t>(48 + v % 10)
        v //= 10
    return d + width

# the record's integers, little-endian whatever the machine's order (as struct's "<" packs them)
cdef inline uint8_t* _put(uint8_t* d, const uint8_t* s, Py_ssize_t n) noexcept nogil:
    memcpy(d, s, n)
    return d + n

cdef inline int _compare(const uint8_t* a, Py_ssize_t na, const uint8_t* c, Py_ssize_t nc) noexcept nogil:
    """`a` against `c` as bytes (and, being ASCII, as str) compare: < 0, 0 or > 0."""
    cdef int r = memcmp(a, c, na if na < nc else nc)
    if r != 0:
        return r
    return (na > nc) - (na < nc)


cdef bytes _slice(const uint8_t* b, Py_ssize_t n):
    return PyBytes_FromStringAndSize(<const char*>b, n)


def walk(bytes body, Py_ssize_t p, int64_t now, int64_t max_delay, int64_t max_body, dict names, dict targets,
         dict queue_names, str broker, tuple limits, object crc32c, list blobs, list ids, list dues, list lengths,
         list key_col, list queues, list offsets, list at):
    """Walk `body` from `p` while the messages are plain, appending each one's record and columns;
    return (where it stopped, messages taken, the last one's queue offset or -1).

    `names`: property name (bytes) to its role; `targets`: target topics (bytes) already checked;
    `queue_names`: queue id to "broker:id" (filled here); `limits`: header size, magic V1, magic V2,
    compressed flag, born-host-V6 flag, store-host-V6 flag, max digits, properties budget less what
    delivery adds, max field; `crc32c`: `crc32c.crc32c`. Neither `names` nor `targets` may change
    during a call: what they said of a name is remembered for the messages after."""
    cdef Py_ssize_t head_size = limits[0]
    cdef int32_t magic_v1 = limits[1], magic_v2 = limits[2]
    cdef int32_t compressed = limits[3], born_v6 = limits[4], store_v6 = limits[5]
    cdef int max_digits = limits[6]
    cdef Py_ssize_t budget = limits[7], max_field = limits[8]
    cdef const uint8_t* b = <const uint8_t*>PyBytes_AS_STRING(body)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef Py_ssize_t taken = 0
    cdef int64_t last = -1
    cdef Py_ssize_t end, q, host, store_len, b0, t0, tlen, plen, props, i, k, s, e, sep
    cdef int32_t total, magic, qid, sys_flag, body_len
    cdef int64_t qoff, phys, born, due, v, base, asked
    cdef Py_ssize_t pair_name[MAX_PAIRS]
    cdef Py_ssize_t pair_name_len[MAX_PAIRS]
    cdef Py_ssize_t pair_value[MAX_PAIRS]
    cdef Py_ssize_t pair_value_len[MAX_PAIRS]
    cdef int carried_rows[MAX_PAIRS]
    cdef Py_ssize_t seen_at[MAX_PAIRS]  # the names looked up so far (in `body`, by place) and their roles
    cdef Py_ssize_t seen_len[MAX_PAIRS]
    cdef int seen_role[MAX_PAIRS]
    cdef int order[MAX_PAIRS]
    cdef int npairs, ncarried, role, w, x, y
    cdef Py_ssize_t slot_at[8]
    cdef Py_ssize_t slot_len[8]
    cdef bint ok
    cdef object role_obj, qname = None
    cdef int32_t qname_of = 0
    cdef bytes tb, rec, ident, last_tb = None
    cdef Py_ssize_t last_target_at = 0, last_target_len = 0
    cdef str msg_id, key
    cdef tuple key_list
    cdef uint8_t* r
    cdef uint8_t* d
    cdef const uint8_t* kp
    cdef const uint8_t* tp
    cdef Py_ssize_t lt, lg, lk, lkeys, lp, lchosen, luniq, li, ldue, lwhen, lident, size, nkeys, ident_at
    cdef uint32_t id_crc, rec_crc
    cdef uint64_t phys_bits
    for w in range(MAX_PAIRS):
        seen_len[w] = -1
    while p < n:
        if p + head_size > n:
            break
        total = _i32(b + p)
        magic = _i32(b + p + 4)
        end = p + total
        if total < head_size or end > n or (magic != magic_v1 and magic != magic_v2):
            break
        qid = _i32(b + p + 12)
        qoff = _i64(b + p + 20)
        phys = _i64(b + p + 28)
        sys_flag = _i32(b + p + 36)
        born = _i64(b + p + 40)
        if sys_flag & compressed:
            break
        host = p + head_size + (20 if sys_flag & born_v6 else 8) + 8
        store_len = 20 if sys_flag & store_v6 else 8
        q = host + store_len + 12
        if q + 4 > end:
            break
        body_len = _i32(b + q)
        b0 = q + 4
        q = b0 + body_len
        if body_len < 0 or q + 3 > end:
            break
        if magic == magic_v1:
            t0 = q + 1
            tlen = b[q]
        else:
            tlen = _i16(b + q)
            t0 = q + 2
            if tlen < 0:
                break
        q = t0 + tlen
        if q + 2 > end or not _ascii(b + t0, tlen):
            break
        plen = _i16(b + q)
        q += 2
        if plen <= 0 or q + plen > end:
            break
        props = q
        # ---- the properties: ASCII, no NUL, each pair one name and one value, the last terminated
        if b[props + plen - 1] != 2 or not _ascii(b + props, plen):
            break
        ok = True
        npairs = 0
        for w in range(8):
            slot_at[w] = -1
            slot_len[w] = 0
        s = props
        e = props + plen - 1  # the final separator
        while ok:
            if npairs >= MAX_PAIRS:
                ok = False
                break
            sep = -1
            k = s
            while k < e and b[k] != 2:
                if b[k] == 1:
                    if sep >= 0:
                        ok = False  # a second separator in one pair
                        break
                    sep = k
                elif b[k] == 0:
                    ok = False
                    break
                k += 1
            if not ok or sep < 0:
                ok = False
                break
            pair_name[npairs] = s
            pair_name_len[npairs] = sep - s
            pair_value[npairs] = sep + 1
            pair_value_len[npairs] = k - sep - 1
            npairs += 1
            if k >= e:
                break
            s = k + 1
        if not ok:
            break
        # ---- each name's role; the last value holds, UNIQ_KEY's first; a carried name only once
        ncarried = 0
        for w in range(npairs):
            # a message's names are mostly the previous one's, in the same places: `names` is
            # asked (a bytes object and a lookup) only for a name not seen last time at that place
            if pair_name_len[w] == seen_len[w] and memcmp(b + pair_name[w], b + seen_at[w], seen_len[w]) == 0:
                role = seen_role[w]
            else:
                role_obj = names.get(_slice(b + pair_name[w], pair_name_len[w]))
                role = UNLISTED if role_obj is None else role_obj
                seen_at[w], seen_len[w], seen_role[w] = pair_name[w], pair_name_len[w], role
            if role == UNLISTED:
                if pair_name_len[w] >= 16 and memcmp(b + pair_name[w], _TRANSIENT, 16) == 0:
                    continue
                for x in range(ncarried):
                    y = carried_rows[x]
                    if pair_name_len[y] == pair_name_len[w] and \
                            memcmp(b + pair_name[y], b + pair_name[w], pair_name_len[w]) == 0:
                        ok = False
                        break
                if not ok:
                    break
                carried_rows[ncarried] = w
                ncarried += 1
                continue
            if role == STOP:
                ok = False
                break
            if role == NOT_CARRIED:
                continue
            if role == UNIQ and slot_at[UNIQ] >= 0:
                continue
            slot_at[role] = pair_value[w]
            slot_len[role] = pair_value_len[w]
        if not ok:
            break
        # ---- the contract: a target already checked, a due time in plain digits within the limits
        if slot_at[TARGET] < 0:
            break
        if last_tb is not None and slot_len[TARGET] == last_target_len and \
                memcmp(b + slot_at[TARGET], b + last_target_at, last_target_len) == 0:
            tb = last_tb  # the previous message's target (`targets` does not change during a walk)
        else:
            tb = targets.get(_slice(b + slot_at[TARGET], slot_len[TARGET]))
            if tb is None:
                break
            last_tb, last_target_at, last_target_len = tb, slot_at[TARGET], slot_len[TARGET]
        due = -1
        asked = -1  # a delay: the id holds it, not the due time (a producer's retry is born again)
        if slot_at[DELIVER_AT] >= 0:
            due = _digits(b + slot_at[DELIVER_AT], slot_len[DELIVER_AT], max_digits)
        elif slot_at[DELAY] >= 0:
            v = _digits(b + slot_at[DELAY], slot_len[DELAY], max_digits)
            # born unset: the broker's store time, which every pull and every replica reads alike
            base = born if born > 0 else _i64(b + host - 8)
            if base <= 0:
                base = now
            if v >= 0 and v <= INT64_MAX - base:  # past int64: the Python walk says what is wrong
                due = base + v
                asked = v
        elif slot_at[START_DELIVER] >= 0:
            due = _digits(b + slot_at[START_DELIVER], slot_len[START_DELIVER], max_digits)
        if not (0 <= due and due - now <= max_delay and body_len <= max_body):
            break
        # ---- the id, the keys and the properties carried, as the Python walk makes them; first
        # their lengths, for the limits (nothing is appended for a message that fails them)
        lg = slot_len[TAGS]
        lkeys = slot_len[KEYS]
        tp = b + slot_at[TAGS] if lg > 0 else b
        kp = b + slot_at[KEYS] if lkeys > 0 else b
        nkeys = lk = 0
        s = 0
        for k in range(lkeys + 1):  # the keys are split on single spaces, the empty ones dropped
            if k == lkeys or kp[k] == 32:
                if k > s:
                    nkeys += 1
                    lk += 2 + k - s
                s = k + 1
        # the id: UNIQ_KEY (else the store host and offset in hex), ':' and 8 hex digits
        luniq = slot_len[UNIQ] if slot_len[UNIQ] > 0 else 2 * (store_len + 8)
        li = luniq + 9
        ldue = _width(due)
        if not (plen + li + ldue <= budget and li <= max_field and lg <= max_field and lk <= max_field):
            break
        lt = PyBytes_GET_SIZE(tb)
        lchosen = 0
        for x in range(ncarried):
            w = carried_rows[x]
            lchosen += pair_name_len[w] + pair_value_len[w] + 2
        lp = lchosen + 2 * ncarried  # each pair's two lengths instead of its two separators
        size = RECORD_HEADER_SIZE + li + lt + lg + lk + lp + body_len
        rec = PyBytes_FromStringAndSize(NULL, size)
        r = <uint8_t*>PyBytes_AS_STRING(rec)
        memcpy(r + size - body_len, b + b0, body_len)
        # the carried properties sorted by name, for the id (insertion sort: they are few)
        for x in range(ncarried):
            order[x] = carried_rows[x]
        for x in range(1, ncarried):
            y = order[x]
            w = x - 1
            while w >= 0 and _compare(b + pair_name[order[w]], pair_name_len[order[w]], b + pair_name[y],
                                      pair_name_len[y]) > 0:
                order[w + 1] = order[w]
                w -= 1
            order[w + 1] = y
        # what the id's CRC covers: target, due time, tags, keys and the sorted carried pairs, each
        # after a NUL, then the body. Written just before the body in the record (the header and the
        # fields overwrite it after) it is one run for one crc32c call; crc32c(body, crc32c(ident))
        # is the CRC of the two run together.
        lwhen = ldue if asked < 0 else 1 + _width(asked)
        lident = lt + lwhen + lg + lkeys + lchosen + 4
        if lident <= size - body_len:
            ident_at = size - body_len - lident
            d = r + ident_at
            ident = None
        else:  # far more spaces among the keys than usual: not room enough, the ident apart
            ident_at = -1
            ident = PyBytes_FromStringAndSize(NULL, lident)
            d = <uint8_t*>PyBytes_AS_STRING(ident)
        d = _put(d, <const uint8_t*>PyBytes_AS_STRING(tb), lt)
        d[0] = 0
        if asked < 0:
            d = _decimal(d + 1, due, ldue)
        else:
            d[1] = 43  # '+'
            d = _decimal(d + 2, asked, lwhen - 1)
        d[0] = 0
        d = _put(d + 1, tp, lg)
        d[0] = 0
        d = _put(d + 1, kp, lkeys)
        d[0] = 0
        d += 1
        for x in range(ncarried):
            w = order[x]
            d = _put(d, b + pair_name[w], pair_name_len[w] + 1 + pair_value_len[w] + 1)  # name, \x01, value, \x02
        if ident_at >= 0:
            id_crc = crc32c(PyMemoryView_FromMemory(<char*>r + ident_at, lident + body_len, PyBUF_READ))
        else:
            id_crc = crc32c(PyMemoryView_FromMemory(<char*>r + size - body_len, body_len, PyBUF_READ),
                            crc32c(ident))
        # ---- the record: `storage.record`'s header (its CRC last), id, topic, tags, keys, properties
        d = write_record_header(r, <uint64_t>size, due, now, <uint64_t>li, <uint64_t>lt, <uint64_t>lg, <uint64_t>lk,
                                <uint64_t>lp, <uint64_t>body_len)
        if slot_len[UNIQ] > 0:
            d = _put(d, b + slot_at[UNIQ], luniq)
        else:  # (store host + commit log offset, 8 bytes big-endian).hex().upper()
            for k in range(store_len):
                d[0] = _HEX_UPPER[b[host + k] >> 4]
                d[1] = _HEX_UPPER[b[host + k] & 15]
                d += 2
            phys_bits = <uint64_t>phys
            for k in range(8):
                y = <int>((phys_bits >> (56 - 8 * k)) & 0xFF)
                d[0] = _HEX_UPPER[y >> 4]
                d[1] = _HEX_UPPER[y & 15]
                d += 2
        d[0] = 58  # ':'
        for k in range(8):
            d[1 + k] = _HEX_LOWER[(id_crc >> (28 - 4 * k)) & 15]
        msg_id = PyUnicode_DecodeASCII(<const char*>r + RECORD_HEADER_SIZE, li, NULL)
        d = _put(d + 9, <const uint8_t*>PyBytes_AS_STRING(tb), lt)
        d = _put(d, tp, lg)
        if nkeys:
            key_list = PyTuple_New(nkeys)
            y = 0
            s = 0
            for k in range(lkeys + 1):
                if k == lkeys or kp[k] == 32:
                    if k > s:
                        d = le16(d, <uint64_t>(k - s))
                        key = PyUnicode_DecodeASCII(<const char*>kp + s, k - s, NULL)
                        Py_INCREF(key)  # PyTuple_SET_ITEM steals a reference
                        PyTuple_SET_ITEM(key_list, y, key)
                        y += 1
                        d = _put(d, kp + s, k - s)
                    s = k + 1
        else:
            key_list = ()
        for x in range(ncarried):  # in their own order, as `encode_properties` writes them
            w = carried_rows[x]
            d = le16(d, <uint64_t>pair_name_len[w])
            d = _put(d, b + pair_name[w], pair_name_len[w])
            d = le16(d, <uint64_t>pair_value_len[w])
            d = _put(d, b + pair_value[w], pair_value_len[w])
        rec_crc = crc32c(PyMemoryView_FromMemory(<char*>r + RECORD_CRC_FROM, size - RECORD_CRC_FROM, PyBUF_READ))
        write_record_crc(r, rec_crc)
        blobs.append(rec)
        ids.append(msg_id)
        dues.append(due)
        lengths.append(body_len)
        key_col.append(key_list)
        if qname is None or qid != qname_of:  # one dict lookup per run of one queue's messages
            qname = queue_names.get(qid)
            if qname is None:
                qname = queue_names[qid] = f"{broker}:{qid}"
            qname_of = qid
        queues.append(qname)
        offsets.append(qoff)
        at.append(p)
        last = qoff
        taken += 1
        p = end
    return p, taken, last
