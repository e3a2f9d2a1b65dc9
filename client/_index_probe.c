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

/* Finds key (its four words: namespace, block hash) by linear probing from its home, j.
 * Returns 1 and sets *loc and *ref where an entry held it, committed, while it was read; 0
 * where the probe met an empty entry, a torn one, or ran out (a miss, never a wrong hit). */
static int probe_key(const uint64_t *table, uint64_t mask, unsigned max_probe, uint64_t j,
                     const uint64_t key[4], uint64_t *loc, uint64_t *ref)
{
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

/* The key words of hash i: from one buffer of joined hashes, or from a list of 16-byte bytes
 * (vLLM's block hashes as they come: joining them first costs more than the probe). */
static int key_words(PyObject *list, const char *joined, Py_ssize_t i, uint64_t out[2])
{
    if (!list) {
        memcpy(out, joined + 16 * i, 16);
        return 1;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(list, i);
    if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) != 16) {
        PyErr_Format(PyExc_ValueError, "hashes[%zd]: not 16 bytes", i);
        return 0;
    }
    memcpy(out, PyBytes_AS_STRING(item), 16);
    return 1;
}

/* Python lists of the first n locations and refs: what a scheduler hands on (numpy arrays and
 * their tolist() cost more than the probe). */
static PyObject *as_lists(Py_ssize_t n, const uint64_t *locs, const uint64_t *refs)
{
    PyObject *loc_list = PyList_New(n), *ref_list = PyList_New(n);
    if (!loc_list || !ref_list)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *loc = PyLong_FromUnsignedLongLong(locs[i]);
        PyObject *ref = PyLong_FromUnsignedLongLong(refs[i]);
        if (!loc || !ref) {
            Py_XDECREF(loc);
            Py_XDECREF(ref);
            goto fail;
        }
        PyList_SET_ITEM(loc_list, i, loc);
        PyList_SET_ITEM(ref_list, i, ref);
    }
    return Py_BuildValue("(nNN)", n, ref_list, loc_list);
fail:
    Py_XDECREF(loc_list);
    Py_XDECREF(ref_list);
    return NULL;
}

/* probe(table, capacity, max_probe, ns, hashes, leading, locs=None, refs=None)
 *
 * table: the mapped segment (header included); capacity: its entries, a power of two; ns: 16
 * bytes; hashes: a list of 16-byte block hashes, or them joined in one bytes-like object.
 * Reads each hash's location and ref (0 and 0 for a miss); with leading true it stops at the
 * first miss. With locs and refs (writable buffers of one 64-bit word per hash) it fills them
 * and returns the number of hashes read (the leading hits), leaving the rest unwritten;
 * without, it returns (that number, refs, locations) as lists of that length.
 *
 * Every key's home entry is prefetched before the first is read: a scheduler sharing its cores
 * with others finds the table cold, and 256 misses one after another cost more than the rest
 * of the lookup; issued together they overlap. */
static PyObject *probe(PyObject *self, PyObject *args)
{
    Py_buffer table, ns, locs = {0}, refs = {0}, joined = {0};
    PyObject *hashes_arg, *locs_arg = Py_None, *refs_arg = Py_None;
    PyObject *list = NULL, *result = NULL;
    unsigned long long capacity;
    unsigned int max_probe;
    int leading;
    enum { ON_STACK = 512 };
    uint64_t stack[3 * ON_STACK], *scratch = stack;

    if (!PyArg_ParseTuple(args, "y*KIy*Op|OO", &table, &capacity, &max_probe, &ns,
                          &hashes_arg, &leading, &locs_arg, &refs_arg))
        return NULL;
    Py_ssize_t n;
    if (PyList_Check(hashes_arg) || PyTuple_Check(hashes_arg)) {
        list = PySequence_Fast(hashes_arg, "hashes");
        if (!list)
            goto out;
        n = PySequence_Fast_GET_SIZE(list);
    } else {
        if (PyObject_GetBuffer(hashes_arg, &joined, PyBUF_SIMPLE) < 0)
            goto out;
        if (joined.len % 16) {
            PyErr_SetString(PyExc_ValueError, "hashes: 16 bytes each");
            goto out;
        }
        n = joined.len / 16;
    }
    if (capacity < 2 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "capacity: not a power of two");
        goto out;
    }
    if ((unsigned long long)table.len < HEADER_BYTES + capacity * ENTRY_WORDS * 8
            || ((uintptr_t)table.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "table: shorter than its capacity, or unaligned");
        goto out;
    }
    if (ns.len != 16) {
        PyErr_SetString(PyExc_ValueError, "ns: 16 bytes");
        goto out;
    }
    if ((locs_arg == Py_None) != (refs_arg == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "locs and refs: both or neither");
        goto out;
    }
    int to_lists = locs_arg == Py_None;
    if (!to_lists) {
        if (PyObject_GetBuffer(locs_arg, &locs, PyBUF_WRITABLE) < 0
                || PyObject_GetBuffer(refs_arg, &refs, PyBUF_WRITABLE) < 0)
            goto out;
        if (!writable_u64(&locs, n, "locs") || !writable_u64(&refs, n, "refs"))
            goto out;
    }
    if (n > ON_STACK) {
        scratch = PyMem_Malloc(3 * n * sizeof *scratch);
        if (!scratch) {
            PyErr_NoMemory();
            goto out;
        }
    }
    uint64_t *homes = scratch;
    uint64_t *loc_out = to_lists ? scratch + n : locs.buf;
    uint64_t *ref_out = to_lists ? scratch + 2 * n : refs.buf;

    const uint64_t *entries = (const uint64_t *)((const char *)table.buf + HEADER_BYTES);
    unsigned shift = 64 - (unsigned)__builtin_ctzll(capacity);
    uint64_t key[4];
    memcpy(key, ns.buf, 16);
    const uint64_t ns_fold = key[0] ^ key[1];
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        uint64_t words[2];
        if (!key_words(list, joined.buf, i, words))
            goto out;
        uint64_t w = ns_fold ^ words[0] ^ words[1];
        w ^= w >> 32;
        homes[i] = (w * HASH_MULTIPLIER) >> shift;
        const char *entry = (const char *)(entries + homes[i] * ENTRY_WORDS);
        __builtin_prefetch(entry);
        __builtin_prefetch(entry + ENTRY_WORDS * 8 - 1);
    }
    for (i = 0; i < n; i++) {
        key_words(list, joined.buf, i, key + 2);      /* checked in the first pass */
        if (!probe_key(entries, capacity - 1, max_probe, homes[i], key, loc_out + i,
                       ref_out + i)) {
            if (leading)
                break;
            loc_out[i] = ref_out[i] = 0;
        }
    }
    result = to_lists ? as_lists(i, loc_out, ref_out) : PyLong_FromSsize_t(i);
out:
    if (scratch != stack)
        PyMem_Free(scratch);
    Py_XDECREF(list);
    if (joined.obj)
        PyBuffer_Release(&joined);
    if (locs.obj)
        PyBuffer_Release(&locs);
    if (refs.obj)
        PyBuffer_Release(&refs);
    PyBuffer_Release(&table);
    PyBuffer_Release(&ns);
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
