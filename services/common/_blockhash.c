/* The block-hash chain of services/common/hashing.py in one C call.
 *
 *     pack(tokens, count) -> bytes             the first `count` tokens as little-endian uint32
 *     planes(tokens, count, wide) -> list[bytes]   the same bytes as 2 or 4 planes (byte p of each)
 *     chain(key, parent, data, block_size) -> list[bytes]
 *     memo_chain(key, parent, data, block_size, span_blocks, young, old) -> list[bytes]
 *
 * h_i = BLAKE2b-128(key; h_{i-1} || block i of the packed tokens `data`), for every block of
 * `data`, starting from h_0 = parent. Keyed BLAKE2b as in RFC 7693 (what hashlib's
 * blake2b(key=..., digest_size=16) computes); tests compare every output with hashlib.
 *
 * Why C: in CPython each block costs a hashlib state copy, two updates and a digest (~0.6 us)
 * (~0.3 us of it Python overhead); array.fromlist packs ~5 ns per token. Here a block costs one
 * compression (~0.3 us on this machine's 2 cores) and packing ~2 ns per token.
 *
 * The module is optional: setup.py builds it when a compiler is there, and hashing.py falls back
 * to hashlib (same values) when it is not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define OUT_BYTES 16
#define BLOCK_BYTES 128

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* Message schedule, one row per round. Rows 10 and 11 repeat rows 0 and 1 (RFC 7693 uses
 * SIGMA[r mod 10]); spelling them out keeps a modulo out of the rounds. */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define G(r, i, a, b, c, d)                      \
    do {                                         \
        a = a + b + m[SIGMA[r][2 * i]];          \
        d = rotr64(d ^ a, 32);                   \
        c = c + d;                               \
        b = rotr64(b ^ c, 24);                   \
        a = a + b + m[SIGMA[r][2 * i + 1]];      \
        d = rotr64(d ^ a, 16);                   \
        c = c + d;                               \
        b = rotr64(b ^ c, 63);                   \
    } while (0)

#define ROUND(r)                                 \
    do {                                         \
        G(r, 0, v[0], v[4], v[8], v[12]);        \
        G(r, 1, v[1], v[5], v[9], v[13]);        \
        G(r, 2, v[2], v[6], v[10], v[14]);       \
        G(r, 3, v[3], v[7], v[11], v[15]);       \
        G(r, 4, v[0], v[5], v[10], v[15]);       \
        G(r, 5, v[1], v[6], v[11], v[12]);       \
        G(r, 6, v[2], v[7], v[8], v[13]);        \
        G(r, 7, v[3], v[4], v[9], v[14]);        \
    } while (0)

/* One compression of a 128-byte block; t = bytes hashed so far including this block. */
static void compress(uint64_t h[8], const uint8_t block[BLOCK_BYTES], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;  /* the counter's high word stays 0: inputs are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    /* Spelled out: with a constant round number every SIGMA index is known at compile time, and
     * m[] and v[] stay in registers (a loop over r read m[] through the table: ~2x slower). */
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Hash `len` bytes of `msg` (len > 0) continuing the keyed state `hk` (key block done). */
static void finish(const uint64_t hk[8], const uint8_t *msg, size_t len, uint8_t out[OUT_BYTES]) {
    uint64_t h[8];
    uint8_t buf[BLOCK_BYTES];
    uint64_t t = BLOCK_BYTES;  /* the key block */
    memcpy(h, hk, sizeof h);
    while (len > BLOCK_BYTES) {
        t += BLOCK_BYTES;
        compress(h, msg, t, 0);
        msg += BLOCK_BYTES;
        len -= BLOCK_BYTES;
    }
    t += len;
    memset(buf, 0, sizeof buf);
    memcpy(buf, msg, len);
    compress(h, buf, t, 1);
    store64(out, h[0]);
    store64(out + 8, h[1]);
}

/* Token ids are int objects scattered over the heap: a request's ids made at different times
 * (each turn, each decode step) sit far apart, and packing waited on a cache miss per id (in
 * the prefix benchmark ~8 us of a 1,350-token request's ~20 us hash, against ~2.5 us packing
 * the same ids again). Loading the int `PREFETCH` ids ahead overlaps those misses. */
#define PREFETCH 16
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_OBJECT(o) __builtin_prefetch((const void *)(o), 0, 3)
#else
#define PREFETCH_OBJECT(o) ((void)0)
#endif

/* `o` as a uint32 where it is an exact int of at most one 30-bit digit (every usual token id),
 * read from its digit without a call; 0 for any other (or where the layout is not CPython
 * 3.11's): the caller asks the C API then. */
static inline int small_token(PyObject *o, uint32_t *v) {
#if PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API) && PYLONG_BITS_IN_DIGIT == 30
    if (!PyLong_CheckExact(o)) return 0;
    Py_ssize_t size = Py_SIZE(o);
    if ((size_t)size <= 1) {  /* 0 or 1 digit; a negative int is no token */
        *v = size ? (uint32_t)((PyLongObject *)o)->ob_digit[0] : 0;
        return 1;
    }
#else
    (void)o;
    (void)v;
#endif
    return 0;
}

/* `tokens` as a fast sequence of at least `count` items, or NULL with an error set. */
static PyObject *token_sequence(PyObject *tokens, Py_ssize_t count) {
    PyObject *seq = PySequence_Fast(tokens, "tokens: a sequence of ints");
    if (seq != NULL && (count < 0 || PySequence_Fast_GET_SIZE(seq) < count)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "count: must be in [0, len(tokens)]");
        return NULL;
    }
    return seq;
}

/* Token `i` of `seq` as a uint32 in `*out`; -1 with an error set where it is none. */
static inline int token_at(PyObject *seq, Py_ssize_t i, uint32_t *out) {
    /* Re-read the item each time: an __index__ method (Python code) may resize the list. */
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "tokens changed size while being packed");
        return -1;
    }
    if (i + PREFETCH < PySequence_Fast_GET_SIZE(seq))
        PREFETCH_OBJECT(PySequence_Fast_GET_ITEM(seq, i + PREFETCH));
    PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
    if (small_token(o, out)) return 0;
    unsigned long v;
    if (PyLong_CheckExact(o)) {
        v = PyLong_AsUnsignedLong(o);
    } else {
        Py_INCREF(o);
        PyObject *ix = PyNumber_Index(o);  /* numpy and torch integers, bools */
        Py_DECREF(o);
        if (ix == NULL) return -1;
        v = PyLong_AsUnsignedLong(ix);
        Py_DECREF(ix);
    }
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (v > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* The first `count` tokens of `seq` (`token_sequence`'s) as bytes: byte p (little-endian) of
 * token i at `dst[p][i * step]`; -1 with an error set. Small exact ints first, in a loop
 * without a call (a third of `token_at`'s instructions a token): no Python code runs there,
 * so `seq` keeps its size and items. From the first other item on, `token_at` reads each (an
 * __index__ method may change `seq`). Inlined: each caller's `step` is a constant. */
static inline int put_tokens(PyObject *seq, Py_ssize_t count, uint8_t *const dst[4],
                             Py_ssize_t step) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i = 0;
    uint32_t v;
    for (; i < count && small_token(items[i], &v); i++) {
        if (i + PREFETCH < count) PREFETCH_OBJECT(items[i + PREFETCH]);
        for (int p = 0; p < 4; p++) dst[p][i * step] = (uint8_t)(v >> (8 * p));
    }
    for (; i < count; i++) {
        if (token_at(seq, i, &v) < 0) return -1;
        for (int p = 0; p < 4; p++) dst[p][i * step] = (uint8_t)(v >> (8 * p));
    }
    return 0;
}

/* pack(tokens, count) -> bytes: the first `count` tokens as little-endian uint32. */
static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "On", &tokens, &count)) return NULL;
    PyObject *seq = token_sequence(tokens, count);
    if (seq == NULL) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out != NULL) {
        uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
        uint8_t *const dst[4] = {p, p + 1, p + 2, p + 3};
        if (put_tokens(seq, count, dst, 4) < 0) Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}

/* planes(tokens, count, wide) -> list[bytes]: byte p of each of the first `count` tokens in
 * plane p (little-endian); the two low planes only where every token is below 2^16 and
 * `wide` is false, else all four (what services/prefix/tree.py keeps per block). */
static PyObject *planes(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t count;
    int wide;
    if (!PyArg_ParseTuple(args, "Onp", &tokens, &count, &wide)) return NULL;
    PyObject *seq = token_sequence(tokens, count);
    if (seq == NULL) return NULL;
    PyObject *pl[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    uint8_t *b[4];
    for (int k = 0; k < 4; k++) {
        pl[k] = PyBytes_FromStringAndSize(NULL, count);
        if (pl[k] == NULL) goto done;
        b[k] = (uint8_t *)PyBytes_AS_STRING(pl[k]);
    }
    if (put_tokens(seq, count, b, 1) < 0) goto done;
    uint8_t high = 0;
    for (Py_ssize_t i = 0; i < count; i++) high |= b[2][i] | b[3][i];
    Py_ssize_t n = wide || high ? 4 : 2;
    out = PyList_New(n);
    for (Py_ssize_t k = 0; out != NULL && k < n; k++) {
        PyList_SET_ITEM(out, k, pl[k]);
        pl[k] = NULL;
    }
done:
    for (int k = 0; k < 4; k++) Py_XDECREF(pl[k]);
    Py_DECREF(seq);
    return out;
}

/* The arguments `chain` and `memo_chain` share, checked; -1 with an error set. */
static int check_chain_args(const Py_buffer *key, const Py_buffer *parent, const Py_buffer *data,
                            Py_ssize_t block_size) {
    if (key->len < 1 || key->len > 64) {
        PyErr_SetString(PyExc_ValueError, "key: 1 to 64 bytes");
        return -1;
    }
    if (parent->len != OUT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "parent: must be 16 bytes");
        return -1;
    }
    if (block_size <= 0 || block_size > (1 << 20) || data->len % (block_size * 4)) {
        PyErr_SetString(PyExc_ValueError,
                        "data: a whole number of blocks of block_size (1 to 2^20) uint32s");
        return -1;
    }
    return 0;
}

/* Appends the digests of the `n_blocks` blocks at `src` (`tok_bytes` each), chained from
 * `parent`, to `out` as 16-byte bytes objects; -1 with an error set. */
static int chain_into(PyObject *out, const Py_buffer *key, const uint8_t parent[OUT_BYTES],
                      const uint8_t *src, Py_ssize_t n_blocks, size_t tok_bytes) {
    if (n_blocks == 0) return 0;
    size_t len = OUT_BYTES + tok_bytes;
    uint8_t *msg = PyMem_Malloc(len);
    uint8_t *digests = PyMem_Malloc((size_t)n_blocks * OUT_BYTES);
    int rc = -1;
    if (msg == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* State after the key block: IV ^ parameter block (digest 16, key length, fanout 1,
     * depth 1), then the key zero-padded to one block. */
    uint64_t hk[8];
    uint8_t kb[BLOCK_BYTES];
    memcpy(hk, IV, sizeof hk);
    hk[0] ^= 0x01010000ULL ^ ((uint64_t)key->len << 8) ^ OUT_BYTES;
    memset(kb, 0, sizeof kb);
    memcpy(kb, key->buf, (size_t)key->len);
    compress(hk, kb, BLOCK_BYTES, 0);
    memcpy(msg, parent, OUT_BYTES);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        memcpy(msg + OUT_BYTES, src + b * tok_bytes, tok_bytes);
        finish(hk, msg, len, digests + b * OUT_BYTES);
        memcpy(msg, digests + b * OUT_BYTES, OUT_BYTES);
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + b * OUT_BYTES, OUT_BYTES);
        if (d == NULL || PyList_Append(out, d) < 0) {
            Py_XDECREF(d);
            goto done;
        }
        Py_DECREF(d);
    }
    rc = 0;
done:
    PyMem_Free(msg);
    PyMem_Free(digests);
    return rc;
}

/* chain(key, parent, data, block_size) -> list[bytes]: the hashes of every block of `data`
 * (packed tokens; its length must be a multiple of 4 * block_size), chained from `parent`. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer key, parent, data;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &key, &parent, &data, &block_size)) return NULL;
    PyObject *out = NULL;
    if (check_chain_args(&key, &parent, &data, block_size) == 0 && (out = PyList_New(0))) {
        size_t tok_bytes = (size_t)block_size * 4;
        if (chain_into(out, &key, parent.buf, data.buf, data.len / tok_bytes, tok_bytes) < 0)
            Py_CLEAR(out);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

/* A new bytes object: `prev` (16 bytes) then `len` bytes of `span` (its first block): a memo
 * key. Its entry holds the rest of the span (see `memo_hit`): the dict hashes 80 bytes of key
 * at 16 tokens a block, not the whole span's 528 (~0.15 us of a lookup, most of it). */
static PyObject *memo_key(const uint8_t prev[OUT_BYTES], const uint8_t *span, size_t len) {
    PyObject *k = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(OUT_BYTES + len));
    if (k != NULL) {
        memcpy(PyBytes_AS_STRING(k), prev, OUT_BYTES);
        memcpy(PyBytes_AS_STRING(k) + OUT_BYTES, span, len);
    }
    return k;
}

/* Whether memo entry `hs` is the span whose bytes after its first block are `rest` (`len`
 * bytes): 1, 0 for another span under the same key, -1 with an error set where `hs` is no
 * entry (a tuple: those bytes, then the span's `span_blocks` digests). */
static int memo_hit(PyObject *hs, const uint8_t *rest, Py_ssize_t len, Py_ssize_t span_blocks) {
    if (!PyTuple_CheckExact(hs) || PyTuple_GET_SIZE(hs) != span_blocks + 1 ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(hs, 0))) {
        PyErr_SetString(PyExc_TypeError, "memo: a span's value is not its rest and digests");
        return -1;
    }
    PyObject *tail = PyTuple_GET_ITEM(hs, 0);
    if (PyBytes_GET_SIZE(tail) != len || memcmp(PyBytes_AS_STRING(tail), rest, (size_t)len))
        return 0;
    for (Py_ssize_t i = 1; i <= span_blocks; i++) {
        PyObject *d = PyTuple_GET_ITEM(hs, i);
        if (!PyBytes_CheckExact(d) || PyBytes_GET_SIZE(d) != OUT_BYTES) {
            PyErr_SetString(PyExc_TypeError, "memo: a digest is not 16 bytes");
            return -1;
        }
    }
    return 1;
}

/* The memo's spans (`span` bytes, the first block `head` of them) from the start of `data`,
 * while they are known (young, else old: promoted into young), appended to `out`; `prev` ends
 * as the last digest taken. Returns the bytes of `data` they cover, or -1 with an error set. */
static Py_ssize_t memo_walk(PyObject *out, PyObject *young, PyObject *old, uint8_t prev[OUT_BYTES],
                            const uint8_t *data, Py_ssize_t len, Py_ssize_t span, Py_ssize_t head,
                            Py_ssize_t span_blocks) {
    Py_ssize_t off = 0;
    while (off + span <= len) {
        PyObject *k = memo_key(prev, data + off, (size_t)head);
        if (k == NULL) return -1;
        PyObject *hs = PyDict_GetItemWithError(young, k);  /* borrowed */
        int hit = 0, promote = hs == NULL;
        if (hs == NULL && !PyErr_Occurred()) hs = PyDict_GetItemWithError(old, k);
        if (hs != NULL) hit = memo_hit(hs, data + off + head, span - head, span_blocks);
        if (hit > 0 && promote && PyDict_SetItem(young, k, hs) < 0) hit = -1;
        Py_DECREF(k);
        if (hit < 0 || PyErr_Occurred()) return -1;
        if (!hit) return off;
        for (Py_ssize_t i = 1; i <= span_blocks; i++)
            if (PyList_Append(out, PyTuple_GET_ITEM(hs, i)) < 0) return -1;
        memcpy(prev, PyBytes_AS_STRING(PyTuple_GET_ITEM(hs, span_blocks)), OUT_BYTES);
        off += span;
    }
    return off;
}

/* Remembers in `young` each whole span of the digests `out[first:]` (the blocks of `data`
 * chained from `prev`): (digest before it ‖ its first block) -> (the rest of its packed
 * tokens, then its digests); an entry of another span under that key is replaced. */
static int memo_store(PyObject *out, Py_ssize_t first, PyObject *young, const uint8_t *prev,
                      const uint8_t *data, Py_ssize_t span, Py_ssize_t head,
                      Py_ssize_t span_blocks) {
    Py_ssize_t n = PyList_GET_SIZE(out);
    for (Py_ssize_t i = first; i + span_blocks <= n; i += span_blocks) {
        const uint8_t *before = i == first ? prev
                                : (const uint8_t *)PyBytes_AS_STRING(PyList_GET_ITEM(out, i - 1));
        const uint8_t *at = data + (i - first) / span_blocks * span;
        PyObject *k = memo_key(before, at, (size_t)head);
        PyObject *t = k == NULL ? NULL : PyTuple_New(span_blocks + 1);
        PyObject *rest = t == NULL ? NULL
                         : PyBytes_FromStringAndSize((const char *)at + head, span - head);
        int rc = -1;
        if (rest != NULL) {
            PyTuple_SET_ITEM(t, 0, rest);
            for (Py_ssize_t j = 0; j < span_blocks; j++) {
                PyObject *d = PyList_GET_ITEM(out, i + j);
                Py_INCREF(d);
                PyTuple_SET_ITEM(t, j + 1, d);
            }
            rc = PyDict_SetItem(young, k, t);
        }
        Py_XDECREF(k);
        Py_XDECREF(t);
        if (rc < 0) return -1;
    }
    return 0;
}

/* memo_chain(key, parent, data, block_size, span_blocks, young, old) -> list[bytes]: what
 * `chain` answers, taking whole spans of `span_blocks` blocks from the memo dicts while they
 * are known and remembering the new ones in `young` (BlockHasher.hashes' memo, one call). */
static PyObject *memo_chain(PyObject *self, PyObject *args) {
    Py_buffer key, parent, data;
    Py_ssize_t block_size, span_blocks;
    PyObject *young, *old;
    if (!PyArg_ParseTuple(args, "y*y*y*nnO!O!", &key, &parent, &data, &block_size, &span_blocks,
                          &PyDict_Type, &young, &PyDict_Type, &old))
        return NULL;
    PyObject *out = NULL;
    if (check_chain_args(&key, &parent, &data, block_size) < 0) goto done;
    if (span_blocks < 1 || span_blocks > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "span_blocks: 1 to 2^20");
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL) goto done;
    size_t tok_bytes = (size_t)block_size * 4;
    Py_ssize_t span = span_blocks * (Py_ssize_t)tok_bytes;
    const uint8_t *buf = data.buf;
    uint8_t prev[OUT_BYTES];
    memcpy(prev, parent.buf, OUT_BYTES);
    Py_ssize_t off = memo_walk(out, young, old, prev, buf, data.len, span, (Py_ssize_t)tok_bytes,
                               span_blocks);
    Py_ssize_t first = PyList_GET_SIZE(out);
    if (off < 0 ||
        chain_into(out, &key, prev, buf + off, (data.len - off) / (Py_ssize_t)tok_bytes,
                   tok_bytes) < 0 ||
        memo_store(out, first, young, prev, buf + off, span, (Py_ssize_t)tok_bytes,
                   span_blocks) < 0)
        Py_CLEAR(out);
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(tokens, count) -> the first count tokens as LE uint32"},
    {"planes", planes, METH_VARARGS,
     "planes(tokens, count, wide) -> the byte planes of the first count tokens (2 or 4)"},
    {"chain", chain, METH_VARARGS,
     "chain(key, parent, data, block_size) -> one 16-byte chained hash per block of data"},
    {"memo_chain", memo_chain, METH_VARARGS,
     "memo_chain(key, parent, data, block_size, span_blocks, young, old) -> chain's answer, "
     "whole spans from and into the memo dicts"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockhash",
    "Chained keyed BLAKE2b-128 block hashes (see services/common/hashing.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
