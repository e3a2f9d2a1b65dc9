/* The shared-memory index's probe, compiled: what client/index_reader.py does with numpy, in
 * one call. A lookup of 256 keys in numpy is ~30 array operations, each a few microseconds of
 * interpreter and dispatch on a busy 2-core host: 40 us of CPU, long enough that eight
 * schedulers sharing two cores are often preempted in the middle of one (issue 37's p99). Here
 * it is one pass over the keys, a few cache lines each.
 *
 * The entry layout, the home hash and the seqlock are shared/index_format.py's; the reader
 * there stays the reference and the fallback where this module was not built (no compiler).
 * Reads follow the seqlock's order: the state word with acquire, the body, an acquire fence,
 * the state again; x86-64 keeps loads in order, so these compile to plain moves, and the
 * atomics only stop the compiler from reordering or merging them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 4096
#define ENTRY_WORDS 6
#define SEQ_ODD 0x100u
#define LOCATION_MASK 0xFFu
#define HASH_MULTIPLIER 0x9E3779B97F4A7C15ull

/* Finds key (its four words: namespace, block hash) by linear probing from its home. Returns 1
 * and sets *loc and *ref where an entry held it, committed, while it was read; 0 where the
 * probe met an empty entry, a torn one, or ran out (a miss, never a wrong hit). */
static int probe_key(const uint64_t *table, uint64_t mask, unsigned shift, unsigned max_probe,
                     const uint64_t key[4], uint64_t *loc, uint64_t *ref)
{
    uint64_t w = key[0] ^ key[1] ^ key[2] ^ key[3];
    w ^= w >> 32;
    uint64_t j = (w * HASH_MULTIPLIER) >> shift;
    for (unsigned step = 0; step < max_probe; step++, j = (j + 1) & mask) {
        const uint64_t *entry = table + j * ENTRY_WORDS;
        uint64_t state = __atomic_load_n(entry, __ATOMIC_ACQUIRE);
        uint64_t body[5];
        for (int k = 0; k < 5; k++)
            body[k] = __atomic_load_n(entry + 1 + k, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint64_t again = __atomic_load_n(entry, __ATOMIC_RELAXED);
        if (state != again || (state & SEQ_ODD) || !(state & LOCATION_MASK))
            return 0;
        if (body[1] == key[0] && body[2] == key[1] && body[3] == key[2] && body[4] == key[3]) {
            *loc = state & LOCATION_MASK;
            *ref = body[0];
            return 1;
        }
    }
    return 0;
}

static int writable_u64(Py_buffer *view, Py_ssize_t n, const char *what)
{
    if (view->len < n * 8 || ((uintptr_t)view->buf & 7)) {
        PyErr_Format(PyExc_ValueError, "%s: needs %zd aligned 64-bit words", what, n);
        return 0;
    }
    return 1;
}

/* probe(table, capacity, max_probe, ns, hashes, leading, locs, refs) -> int
 *
 * table: the mapped segment (header included); capacity: its entries, a power of two; ns: 16
 * bytes; hashes: the block hashes joined, 16 bytes each; locs, refs: writable buffers of at
 * least one 64-bit word per hash. Fills locs and refs (0 and 0 for a miss) and returns the
 * number of hashes; with leading true it stops at the first miss and returns the hits before
 * it, leaving the rest of locs and refs unwritten. */
static PyObject *probe(PyObject *self, PyObject *args)
{
    Py_buffer table, ns, hashes, locs, refs;
    unsigned long long capacity;
    unsigned int max_probe;
    int leading;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "y*KIy*y*pw*w*", &table, &capacity, &max_probe, &ns, &hashes,
                          &leading, &locs, &refs))
        return NULL;
    Py_ssize_t n = hashes.len / 16;
    if (capacity < 2 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "capacity: not a power of two");
        goto out;
    }
    if ((unsigned long long)table.len < HEADER_BYTES + capacity * ENTRY_WORDS * 8
            || ((uintptr_t)table.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "table: shorter than its capacity, or unaligned");
        goto out;
    }
    if (ns.len != 16 || hashes.len % 16) {
        PyErr_SetString(PyExc_ValueError, "ns: 16 bytes; hashes: 16 bytes each");
        goto out;
    }
    if (!writable_u64(&locs, n, "locs") || !writable_u64(&refs, n, "refs"))
        goto out;

    const uint64_t *entries = (const uint64_t *)((const char *)table.buf + HEADER_BYTES);
    unsigned shift = 64 - (unsigned)__builtin_ctzll(capacity);
    uint64_t *loc_out = locs.buf, *ref_out = refs.buf;
    uint64_t key[4];
    memcpy(key, ns.buf, 16);
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        memcpy(key + 2, (const char *)hashes.buf + 16 * i, 16);
        if (!probe_key(entries, capacity - 1, shift, max_probe, key, loc_out + i, ref_out + i)) {
            if (leading)
                break;
            loc_out[i] = ref_out[i] = 0;
        }
    }
    result = PyLong_FromSsize_t(i);
out:
    PyBuffer_Release(&table);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&locs);
    PyBuffer_Release(&refs);
    return result;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "Probe the shared-memory index for a run of keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_index_probe",
    "The shared-memory index's probe, compiled (see client/index_reader.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__index_probe(void)
{
    return PyModule_Create(&module);
}
