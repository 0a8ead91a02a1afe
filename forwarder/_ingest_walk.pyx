# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled loop of ingest's one pass (`forwarder._ingest_pass.OnePass`): the plainest messages
of a pull answer, walked in C straight to the record bytes and the columns.

It takes a message only when every byte of its topic and properties is ASCII, none of its own
properties repeats, its target is one already checked and everything else is as the Python walk's
one pass takes it; at the first message it is not sure of, it stops and says where, and the Python
walk (the reference) decides that one message, then hands back. What it writes for a message is
what the Python walk writes, byte for byte: the record through `storage.encode_fields` itself,
the id through `crc32c` itself (tests/forwarder/test_ingest_pass.py holds both walks to the
general path). Names are classified by the caller (`forwarder._ingest_pass`), not here.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

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


cdef bytes _slice(const uint8_t* b, Py_ssize_t n):
    return PyBytes_FromStringAndSize(<const char*>b, n)


def walk(bytes body, object mv, Py_ssize_t p, int64_t now, int64_t max_delay, int64_t max_body, dict names,
         dict targets, dict queue_names, str broker, tuple limits, object encode_fields, object crc32c, list blobs,
         list ids, list dues, list lengths, list key_col, list queues, list offsets, list at):
    """Walk `body` from `p` while the messages are plain, appending each one's record and columns;
    return (where it stopped, messages taken, the last one's queue offset or -1).

    `names`: property name (bytes) to its role; `targets`: target topics (bytes) already checked;
    `queue_names`: queue id to "broker:id" (filled here); `limits`: header size, magic V1, magic V2,
    compressed flag, born-host-V6 flag, store-host-V6 flag, max digits, properties budget less what
    delivery adds, max field."""
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
    cdef int64_t qoff, phys, born, due, v
    cdef Py_ssize_t pair_name[MAX_PAIRS]
    cdef Py_ssize_t pair_name_len[MAX_PAIRS]
    cdef Py_ssize_t pair_value[MAX_PAIRS]
    cdef Py_ssize_t pair_value_len[MAX_PAIRS]
    cdef int carried_rows[MAX_PAIRS]
    cdef int order[MAX_PAIRS]
    cdef int npairs, ncarried, role, w, x, y
    cdef Py_ssize_t slot_at[8]
    cdef Py_ssize_t slot_len[8]
    cdef bint ok
    cdef object role_obj
    cdef bytes name, tb, uniq, ident, idb, tagb, kb, pb, chosen, due_text
    cdef str msg_id
    cdef tuple key_list
    cdef list key_strs, parts
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
            name = _slice(b + pair_name[w], pair_name_len[w])
            role_obj = names.get(name)
            if role_obj is None:
                if pair_name_len[w] >= 16 and name.startswith(b"__RMQ.TRANSIENT."):
                    continue
                for x in range(ncarried):
                    y = carried_rows[x]
                    if pair_name_len[y] == pair_name_len[w] and \
                            _slice(b + pair_name[y], pair_name_len[y]) == name:
                        ok = False
                        break
                if not ok:
                    break
                carried_rows[ncarried] = w
                ncarried += 1
                continue
            role = role_obj
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
        tb = targets.get(_slice(b + slot_at[TARGET], slot_len[TARGET]))
        if tb is None:
            break
        due = -1
        if slot_at[DELIVER_AT] >= 0:
            due = _digits(b + slot_at[DELIVER_AT], slot_len[DELIVER_AT], max_digits)
        elif slot_at[DELAY] >= 0:
            v = _digits(b + slot_at[DELAY], slot_len[DELAY], max_digits)
            if v >= 0:
                due = (born if born > 0 else now) + v
        elif slot_at[START_DELIVER] >= 0:
            due = _digits(b + slot_at[START_DELIVER], slot_len[START_DELIVER], max_digits)
        if not (0 <= due and due - now <= max_delay and body_len <= max_body):
            break
        # ---- the id, the keys and the properties carried, as the Python walk makes them
        tagb = _slice(b + slot_at[TAGS], slot_len[TAGS]) if slot_len[TAGS] > 0 else b""
        key_strs = []
        if slot_len[KEYS] > 0:
            s = slot_at[KEYS]
            e = s + slot_len[KEYS]
            k = s
            while k <= e:
                if k == e or b[k] == 32:
                    if k > s:
                        key_strs.append(_slice(b + s, k - s).decode("ascii"))
                    s = k + 1
                k += 1
        key_list = tuple(key_strs)
        if slot_len[UNIQ] > 0:
            uniq = _slice(b + slot_at[UNIQ], slot_len[UNIQ])
        else:
            uniq = (_slice(b + host, store_len) + phys.to_bytes(8, "big", signed=True)).hex().upper().encode()
        due_text = str(due).encode()
        # the carried properties sorted by name, for the id (insertion sort: they are few)
        for x in range(ncarried):
            order[x] = carried_rows[x]
        for x in range(1, ncarried):
            y = order[x]
            w = x - 1
            while w >= 0 and _slice(b + pair_name[order[w]], pair_name_len[order[w]]) > \
                    _slice(b + pair_name[y], pair_name_len[y]):
                order[w + 1] = order[w]
                w -= 1
            order[w + 1] = y
        parts = []
        for x in range(ncarried):
            w = order[x]
            parts.append(_slice(b + pair_name[w], pair_name_len[w] + 1 + pair_value_len[w] + 1))
        chosen = b"".join(parts)
        ident = b"".join((_slice(b + slot_at[TARGET], slot_len[TARGET]), b"\x00", due_text, b"\x00", tagb, b"\x00",
                          _slice(b + slot_at[KEYS], slot_len[KEYS]) if slot_len[KEYS] > 0 else b"", b"\x00",
                          chosen))
        payload = mv[b0:b0 + body_len]
        msg_id = f"{uniq.decode('ascii')}:{crc32c(payload, crc32c(ident)):08x}"
        idb = msg_id.encode("ascii")
        parts = []
        for key in key_strs:
            parts.append((<int>len(key)).to_bytes(2, "little"))
            parts.append((<str>key).encode("ascii"))
        kb = b"".join(parts)
        if not (plen + len(idb) + len(due_text) <= budget and len(idb) <= max_field and len(tagb) <= max_field
                and len(kb) <= max_field):
            break
        parts = []
        for x in range(ncarried):
            w = carried_rows[x]
            parts.append((<int>pair_name_len[w]).to_bytes(2, "little"))
            parts.append(_slice(b + pair_name[w], pair_name_len[w]))
            parts.append((<int>pair_value_len[w]).to_bytes(2, "little"))
            parts.append(_slice(b + pair_value[w], pair_value_len[w]))
        pb = b"".join(parts)
        blobs.append(encode_fields(due, now, idb, tb, tagb, kb, pb, payload))
        ids.append(msg_id)
        dues.append(due)
        lengths.append(body_len)
        key_col.append(key_list)
        qname = queue_names.get(qid)
        if qname is None:
            qname = queue_names[qid] = f"{broker}:{qid}"
        queues.append(qname)
        offsets.append(qoff)
        at.append(p)
        last = qoff
        taken += 1
        p = end
    return p, taken, last
