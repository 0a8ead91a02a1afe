# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled `codec.derived_id`: the same 32 hex digits, without a Python object per step.

The keyed BLAKE2b (RFC 7693) is computed here, from the state after the key's block (taken once, as
`codec` takes a copy of a keyed hash object), and the UTC month start by the civil-date arithmetic
of the proleptic Gregorian calendar. Times outside year 1 to November 9999 go to the Python reference, which
says what is wrong with them. tests/forwarder/rocketmq/test_codec.py holds both to hashlib and to
each other, byte for byte, under hypothesis.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy, memset

cdef uint64_t _IV[8]
cdef uint8_t _SIGMA[10][16]
cdef uint64_t _PARAM[8]  # the state before the key's block
cdef uint8_t _KEY_BLOCK[128]
cdef uint64_t _KEYED[8]  # the state once the key's block is compressed (a seed follows it)
cdef int64_t _ZONE_MARGIN_MS = 12 * 3600 * 1000
cdef int64_t _DAY_MS = 86_400_000
cdef int64_t _MIN_MS = -62_135_596_800_000  # 0001-01-01 UTC
cdef int64_t _MAX_MS = 253_399_622_400_000  # 9999-12-01 UTC (the reference cannot name the month after)
cdef int64_t _month_start = 0, _month_end = 0  # [start, end) of the last month asked for
cdef const char* _HEX = b"0123456789ABCDEF"
cdef object _reference = None  # the Python function, for what is not taken here


cdef inline uint64_t _rotr(uint64_t x, int n) noexcept nogil:
    return (x >> n) | (x << (64 - n))


cdef inline void _g(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) noexcept nogil:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


cdef void _compress(uint64_t* h, const uint8_t* block, uint64_t t, bint last) noexcept nogil:
    cdef uint64_t v[16]
    cdef uint64_t m[16]
    cdef int i, r
    cdef const uint8_t* s
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = _IV[i]
    v[12] ^= t  # the counter's high word stays 0: messages here are far below 2**64 bytes
    if last:
        v[14] = ~v[14]
    memcpy(m, block, 128)  # little-endian words: this machine's order (x86-64, aarch64)
    for r in range(12):
        s = _SIGMA[r % 10]
        _g(v, 0, 4, 8, 12, m[s[0]], m[s[1]])
        _g(v, 1, 5, 9, 13, m[s[2]], m[s[3]])
        _g(v, 2, 6, 10, 14, m[s[4]], m[s[5]])
        _g(v, 3, 7, 11, 15, m[s[6]], m[s[7]])
        _g(v, 0, 5, 10, 15, m[s[8]], m[s[9]])
        _g(v, 1, 6, 11, 12, m[s[10]], m[s[11]])
        _g(v, 2, 7, 8, 13, m[s[12]], m[s[13]])
        _g(v, 3, 4, 9, 14, m[s[14]], m[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


cdef void _keyed_digest(const uint8_t* msg, Py_ssize_t n, uint8_t* out12) noexcept nogil:
    """The first 12 bytes of the keyed hash of `msg` (a key was set up by `_init`)."""
    cdef uint64_t h[8]
    cdef uint8_t block[128]
    cdef uint64_t t = 128
    if n == 0:  # the key's block is the last
        memcpy(h, _PARAM, sizeof(h))
        _compress(h, _KEY_BLOCK, 128, True)
        memcpy(out12, h, 12)
        return
    memcpy(h, _KEYED, sizeof(h))
    while n > 128:
        t += 128
        _compress(h, msg, t, False)
        msg += 128
        n -= 128
    memset(block, 0, 128)
    memcpy(block, msg, n)
    t += <uint64_t>n
    _compress(h, block, t, True)
    memcpy(out12, h, 12)


cdef inline int64_t _floor_div(int64_t a, int64_t b) noexcept nogil:
    cdef int64_t q = a / b
    if (a % b != 0) and ((a < 0) != (b < 0)):
        q -= 1
    return q


cdef int64_t _days_from_civil(int64_t y, int64_t m, int64_t d) noexcept nogil:
    cdef int64_t era, yoe, doy, doe
    if m <= 2:
        y -= 1
    era = _floor_div(y, 400)
    yoe = y - era * 400
    doy = (153 * (m - 3 if m > 2 else m + 9) + 2) / 5 + d - 1
    doe = yoe * 365 + yoe / 4 - yoe / 100 + doy
    return era * 146097 + doe - 719468


cdef void _month_of(int64_t ms) noexcept nogil:
    """Set the cached month to the UTC month holding `ms`."""
    global _month_start, _month_end
    cdef int64_t z = _floor_div(ms, _DAY_MS) + 719468
    cdef int64_t era = _floor_div(z, 146097)
    cdef int64_t doe = z - era * 146097
    cdef int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365
    cdef int64_t y = yoe + era * 400
    cdef int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
    cdef int64_t mp = (5 * doy + 2) / 153
    cdef int64_t m = mp + 3 if mp < 10 else mp - 9
    if m <= 2:
        y += 1
    _month_start = _days_from_civil(y, m, 1) * _DAY_MS
    _month_end = (_days_from_civil(y + 1, 1, 1) if m == 12 else _days_from_civil(y, m + 1, 1)) * _DAY_MS


def derived_id(object seed, object at_ms):
    """`codec.derived_id(seed, at_ms)`; the reference given to `_init` takes what this does not: a
    seed that is not bytes, a time that is not an int or lies outside year 1 to November 9999."""
    cdef int64_t t
    cdef uint8_t raw[16]
    cdef char text[32]
    cdef uint64_t since
    cdef int i, overflow = 1
    cdef long long at = 0
    if type(seed) is bytes and type(at_ms) is int:
        at = PyLong_AsLongLongAndOverflow(at_ms, &overflow)
    if overflow or not (_MIN_MS + _ZONE_MARGIN_MS <= at < _MAX_MS):
        if _reference is None:
            raise TypeError("derived_id takes bytes and an int time from year 1 to November 9999 here")
        return _reference(seed, at_ms)
    t = <int64_t>at - _ZONE_MARGIN_MS
    if not _month_start <= t < _month_end:
        _month_of(t)
    since = <uint64_t>(t - _month_start)
    _keyed_digest(<const uint8_t*>PyBytes_AS_STRING(seed), PyBytes_GET_SIZE(seed), raw)
    # the layout of codec._DERIVED_LAYOUT: 10 bytes of hash, the time field big-endian, 2 of hash
    raw[15] = raw[11]
    raw[14] = raw[10]
    raw[10] = (since >> 24) & 0xFF
    raw[11] = (since >> 16) & 0xFF
    raw[12] = (since >> 8) & 0xFF
    raw[13] = since & 0xFF
    for i in range(16):
        text[2 * i] = _HEX[raw[i] >> 4]
        text[2 * i + 1] = _HEX[raw[i] & 15]
    return PyUnicode_DecodeASCII(text, 32, NULL)


def _init(bytes key, object reference) -> None:
    """Set the key (at most 64 bytes; the digest is 12 bytes) and the reference function; once, at import."""
    global _reference
    cdef int i, j
    iv = (0x6a09e667f3bcc908, 0xbb67ae8584caa73b, 0x3c6ef372fe94f82b, 0xa54ff53a5f1d36f1,
          0x510e527fade682d1, 0x9b05688c2b3e6c1f, 0x1f83d9abfb41bd6b, 0x5be0cd19137e2179)
    sigma = ((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
             (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
             (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
             (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
             (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
             (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
             (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
             (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
             (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
             (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0))
    if not 0 < len(key) <= 64:
        raise ValueError("a BLAKE2b key of 1-64 bytes")
    _reference = reference
    for i in range(8):
        _IV[i] = iv[i]
        _KEYED[i] = iv[i]
    for i in range(10):
        for j in range(16):
            _SIGMA[i][j] = sigma[i][j]
    _KEYED[0] ^= 0x01010000 ^ (<uint64_t>len(key) << 8) ^ 12
    memcpy(_PARAM, _KEYED, sizeof(_PARAM))
    memset(_KEY_BLOCK, 0, 128)
    memcpy(_KEY_BLOCK, PyBytes_AS_STRING(key), len(key))
    _compress(_KEYED, _KEY_BLOCK, 128, False)
