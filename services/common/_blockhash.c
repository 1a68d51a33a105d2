/* The block-hash chain of services/common/hashing.py in one C call.
 *
 *     pack(tokens, count) -> bytes             the first `count` tokens as little-endian uint32
 *     chain(key, parent, data, block_size) -> list[bytes]
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

/* `o` (an exact int) as a uint32 read from its one 30-bit digit, without a call; 0 where it
 * needs more digits (or its layout is not CPython 3.11's): the caller asks the C API then. */
static inline int small_value(PyObject *o, unsigned long *v) {
#if PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API) && PYLONG_BITS_IN_DIGIT == 30
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0 || size == 1) {
        *v = size ? (unsigned long)((PyLongObject *)o)->ob_digit[0] : 0;
        return 1;
    }
#else
    (void)o;
    (void)v;
#endif
    return 0;
}

/* pack(tokens, count) -> bytes: the first `count` tokens as little-endian uint32. */
static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "On", &tokens, &count)) return NULL;
    PyObject *seq = PySequence_Fast(tokens, "tokens: a sequence of ints");
    if (seq == NULL) return NULL;
    if (count < 0 || PySequence_Fast_GET_SIZE(seq) < count) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "count: must be in [0, len(tokens)]");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++, p += 4) {
        /* Re-read the item each time: an __index__ method (Python code) may resize the list. */
        if (i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "tokens changed size while being packed");
            goto fail;
        }
        if (i + PREFETCH < PySequence_Fast_GET_SIZE(seq))
            PREFETCH_OBJECT(PySequence_Fast_GET_ITEM(seq, i + PREFETCH));
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long v;
        if (PyLong_CheckExact(o)) {
            if (!small_value(o, &v)) v = PyLong_AsUnsignedLong(o);
        } else {
            Py_INCREF(o);
            PyObject *ix = PyNumber_Index(o);  /* numpy and torch integers, bools */
            Py_DECREF(o);
            if (ix == NULL) goto fail;
            v = PyLong_AsUnsignedLong(ix);
            Py_DECREF(ix);
        }
        if (v == (unsigned long)-1 && PyErr_Occurred()) goto fail;
        if (v > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
            goto fail;
        }
        p[0] = (uint8_t)v;
        p[1] = (uint8_t)(v >> 8);
        p[2] = (uint8_t)(v >> 16);
        p[3] = (uint8_t)(v >> 24);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* chain(key, parent, data, block_size) -> list[bytes]: the hashes of every block of `data`
 * (packed tokens; its length must be a multiple of 4 * block_size), chained from `parent`. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer key, parent, data;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &key, &parent, &data, &block_size)) return NULL;
    PyObject *out = NULL;
    uint8_t *msg = NULL, *digests = NULL;
    if (key.len < 1 || key.len > 64) {
        PyErr_SetString(PyExc_ValueError, "key: 1 to 64 bytes");
        goto done;
    }
    if (parent.len != OUT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "parent: must be 16 bytes");
        goto done;
    }
    if (block_size <= 0 || block_size > (1 << 20) || data.len % (block_size * 4)) {
        PyErr_SetString(PyExc_ValueError,
                        "data: a whole number of blocks of block_size (1 to 2^20) uint32s");
        goto done;
    }
    Py_ssize_t n_blocks = data.len / (block_size * 4);
    size_t tok_bytes = (size_t)block_size * 4, len = OUT_BYTES + tok_bytes;
    msg = PyMem_Malloc(len);
    digests = PyMem_Malloc((size_t)(n_blocks ? n_blocks : 1) * OUT_BYTES);
    if (msg == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* State after the key block: IV ^ parameter block (digest 16, key length, fanout 1,
     * depth 1), then the key zero-padded to one block. */
    uint64_t hk[8];
    uint8_t kb[BLOCK_BYTES];
    memcpy(hk, IV, sizeof hk);
    hk[0] ^= 0x01010000ULL ^ ((uint64_t)key.len << 8) ^ OUT_BYTES;
    memset(kb, 0, sizeof kb);
    memcpy(kb, key.buf, (size_t)key.len);
    compress(hk, kb, BLOCK_BYTES, 0);
    memcpy(msg, parent.buf, OUT_BYTES);
    const uint8_t *src = data.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        memcpy(msg + OUT_BYTES, src + b * tok_bytes, tok_bytes);
        finish(hk, msg, len, digests + b * OUT_BYTES);
        memcpy(msg, digests + b * OUT_BYTES, OUT_BYTES);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n_blocks);
    if (out == NULL) goto done;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + b * OUT_BYTES, OUT_BYTES);
        if (d == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, b, d);
    }
done:
    PyMem_Free(msg);
    PyMem_Free(digests);
    PyBuffer_Release(&key);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(tokens, count) -> the first count tokens as LE uint32"},
    {"chain", chain, METH_VARARGS,
     "chain(key, parent, data, block_size) -> one 16-byte chained hash per block of data"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockhash",
    "Chained keyed BLAKE2b-128 block hashes (see services/common/hashing.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
