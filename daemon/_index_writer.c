/* The shared-memory index's writer, compiled: what daemon/index_entries.py does in Python, one
 * call per batch. A store of 1024 blocks on a full pool withdraws 1024 keys and publishes 1024:
 * in Python each is a dict probe, a list walk and a seqlock write of six words, ~4 us of the
 * event loop per stored block, a fifth of its busiest thread at the host's copy rate (issue
 * 36). Here each is a probe of a private mirror and six stores.
 *
 * The entry layout, the home hash and the seqlock are shared/index_format.py's; the Python
 * writer stays the reference and the fallback where this module was not built (no compiler).
 * Which entry holds which key is kept in a mirror of our own (never read back from the shared
 * segment, which any process of the daemon's user could scribble on: a probe of the mirror
 * always ends, at the empty entries the load limit keeps). A write follows the seqlock's
 * order: the state made odd, a release fence, the body, the state made even with release; on
 * x86-64 these are plain moves, the atomics only keep the compiler from reordering them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <unistd.h>

#define HEADER_BYTES 4096
#define H_PUBLISHED 64
#define ENTRY_WORDS 6
#define LOCATION_MASK 0xFFull
#define EMPTY 0
#define HASH_MULTIPLIER 0x9E3779B97F4A7C15ull

typedef struct {
    PyObject_HEAD
    Py_buffer segment;          /* the whole mapping: header, then entries */
    int has_segment;
    uint64_t *table;
    uint64_t (*keys)[4];        /* entry -> the key it holds (the mirror) */
    uint8_t *used;              /* entry -> holds a key */
    uint64_t mask;
    unsigned bits;
    Py_ssize_t limit;           /* keys published at most */
    Py_ssize_t published;
    Py_ssize_t unpublished;     /* new keys refused: the table was at its limit */
    int prefaulting;            /* a prefault() runs without the GIL: close() must wait */
} Writer;

static uint64_t home(const uint64_t k[4], unsigned bits)
{
    uint64_t w = k[0] ^ k[1] ^ k[2] ^ k[3];
    w ^= w >> 32;
    return (w * HASH_MULTIPLIER) >> (64 - bits);
}

static void write_entry(uint64_t *entry, uint64_t location, uint64_t ref, const uint64_t key[4])
{
    uint64_t state = entry[0];
    uint64_t seq = state >> 8;
    __atomic_store_n(entry, ((seq + 1) << 8) | (state & LOCATION_MASK), __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(entry + 1, ref, __ATOMIC_RELAXED);
    for (int k = 0; k < 4; k++)
        __atomic_store_n(entry + 2 + k, key ? key[k] : 0, __ATOMIC_RELAXED);
    __atomic_store_n(entry, ((seq + 2) << 8) | location, __ATOMIC_RELEASE);
}

/* The entry holding key, or -1 with *free_at the empty entry its probe ended on. */
static Py_ssize_t find(const Writer *w, const uint64_t key[4], uint64_t *free_at)
{
    uint64_t j = home(key, w->bits);
    while (w->used[j]) {
        if (!memcmp(w->keys[j], key, 32))
            return (Py_ssize_t)j;
        j = (j + 1) & w->mask;
    }
    *free_at = j;
    return -1;
}

static void publish_count(Writer *w)
{
    __atomic_store_n((uint64_t *)((char *)w->segment.buf + H_PUBLISHED), (uint64_t)w->published,
                     __ATOMIC_RELAXED);
}

static int ready(const Writer *w)
{
    if (!w->has_segment) {
        PyErr_SetString(PyExc_ValueError, "the index writer is closed");
        return 0;
    }
    return 1;
}

/* Every item of seq a 32-byte bytes, checked before anything is written: a bad batch changes
 * nothing. */
static PyObject *checked_keys(PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys: a list of 32-byte bytes");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != 32) {
            PyErr_Format(PyExc_ValueError, "keys[%zd]: not 32 bytes (namespace + block hash)", i);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

static void key_words(PyObject *k, uint64_t out[4])
{
    memcpy(out, PyBytes_AS_STRING(k), 32);
}

static int Writer_init(Writer *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"segment", "capacity", "limit", NULL};
    PyObject *segment;
    Py_ssize_t capacity, limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onn", names, &segment, &capacity, &limit))
        return -1;
    if (self->has_segment) {
        PyErr_SetString(PyExc_ValueError, "the index writer is already set up");
        return -1;
    }
    if (capacity < 2 || (capacity & (capacity - 1))) {
        PyErr_Format(PyExc_ValueError, "capacity %zd: not a power of two", capacity);
        return -1;
    }
    if (limit < 0 || limit >= capacity) {
        /* a probe ends at an empty entry: the table may never fill */
        PyErr_Format(PyExc_ValueError, "limit %zd: must be below the capacity %zd", limit,
                     capacity);
        return -1;
    }
    if (PyObject_GetBuffer(segment, &self->segment, PyBUF_WRITABLE) < 0)
        return -1;
    self->has_segment = 1;
    if (self->segment.len < HEADER_BYTES + capacity * ENTRY_WORDS * 8
            || ((uintptr_t)self->segment.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "segment: %zd bytes, needs %zd aligned for %zd entries",
                     self->segment.len, HEADER_BYTES + capacity * ENTRY_WORDS * 8, capacity);
        return -1;
    }
    /* calloc: the pages of a large, mostly empty table are never touched */
    self->keys = calloc((size_t)capacity, sizeof *self->keys);
    self->used = calloc((size_t)capacity, 1);
    if (!self->keys || !self->used) {
        PyErr_NoMemory();
        return -1;
    }
    self->table = (uint64_t *)((char *)self->segment.buf + HEADER_BYTES);
    self->mask = (uint64_t)capacity - 1;
    self->bits = 0;
    while (((Py_ssize_t)1 << self->bits) < capacity)
        self->bits++;
    self->limit = limit;
    return 0;
}

static void release(Writer *self)
{
    if (self->has_segment) {
        PyBuffer_Release(&self->segment);
        self->has_segment = 0;
    }
    free(self->keys);
    free(self->used);
    self->keys = NULL;
    self->used = NULL;
}

static void Writer_dealloc(Writer *self)
{
    release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Writer_close(Writer *self, PyObject *unused)
{
    if (self->prefaulting) {
        PyErr_SetString(PyExc_RuntimeError, "the index writer is prefaulting: join it first");
        return NULL;
    }
    release(self);
    Py_RETURN_NONE;
}

/* Every page of [start, start + len) mapped now, writable, with no byte changed: a key's
 * entry and its mirror sit at a random place of a table sized for the smallest blocks, so
 * without this nearly every new key took a page fault or two on the event loop (16 us a key on
 * a 2-core VM, 0.2 ms for a store's last 32 slots on an H200 host). One atomic compare-and-swap
 * per page (a locked write that stores what it read: safe beside the loop's writes to the same
 * page), so each page costs an ordinary fault, as it would have on the loop. Not
 * MADV_POPULATE_WRITE: with it the loop of a daemon on an H200 host stopped for up to 207 ms
 * (blocked, not running) while a 2**21-entry table was populated, even in 256 KiB calls. */
static void populate(void *start, size_t len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)start + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)start + len) & ~(page - 1);
    unsigned n = 0;
    for (uintptr_t p = lo; p < hi; p += page) {
        uint8_t seen = 0;
        __atomic_compare_exchange_n((uint8_t *)p, &seen, 0, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        if (++n % 256 == 0)
            sched_yield();
    }
}

static PyObject *Writer_prefault(Writer *self, PyObject *unused)
{
    if (!ready(self))
        return NULL;
    size_t capacity = (size_t)self->mask + 1;
    void *keys = self->keys, *used = self->used, *table = self->table;
    self->prefaulting++;
    Py_BEGIN_ALLOW_THREADS
    populate(keys, capacity * sizeof *self->keys);
    populate(used, capacity);
    populate(table, capacity * ENTRY_WORDS * 8);
    Py_END_ALLOW_THREADS
    self->prefaulting--;
    Py_RETURN_NONE;
}

static PyObject *Writer_put_many(Writer *self, PyObject *args)
{
    PyObject *keys, *refs = Py_None;
    unsigned long long location;
    if (!PyArg_ParseTuple(args, "OK|O", &keys, &location, &refs) || !ready(self))
        return NULL;
    if (location == EMPTY || location > LOCATION_MASK)
        return PyErr_Format(PyExc_ValueError, "location %llu: not a location", location);
    PyObject *seq = checked_keys(keys);
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *ref_seq = NULL;
    uint64_t *ref_words = NULL;
    if (refs != Py_None) {
        ref_seq = PySequence_Fast(refs, "refs: a list of ints");
        if (!ref_seq)
            goto fail;
        if (PySequence_Fast_GET_SIZE(ref_seq) != n) {
            PyErr_Format(PyExc_ValueError, "%zd refs for %zd keys", PySequence_Fast_GET_SIZE(ref_seq), n);
            goto fail;
        }
        ref_words = PyMem_Malloc((n ? n : 1) * sizeof *ref_words);
        if (!ref_words) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            ref_words[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(ref_seq, i));
            if (ref_words[i] == (uint64_t)-1 && PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "refs[%zd]: not a 64-bit unsigned int", i);
                goto fail;
            }
        }
    }
    Py_ssize_t published = 0;
    int grew = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key[4], at = 0;
        key_words(PySequence_Fast_GET_ITEM(seq, i), key);
        Py_ssize_t j = find(self, key, &at);
        if (j < 0) {
            if (self->published >= self->limit) {
                self->unpublished++;
                continue;
            }
            memcpy(self->keys[at], key, 32);
            self->used[at] = 1;
            self->published++;
            grew = 1;
            j = (Py_ssize_t)at;
        }
        write_entry(self->table + j * ENTRY_WORDS, location, ref_words ? ref_words[i] : 0, key);
        published++;
    }
    if (grew)
        publish_count(self);
    PyMem_Free(ref_words);
    Py_XDECREF(ref_seq);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(published);
fail:
    PyMem_Free(ref_words);
    Py_XDECREF(ref_seq);
    Py_DECREF(seq);
    return NULL;
}

/* Withdraws keys (those not published are skipped); the entries after each in its cluster move
 * back so that no probe needs a tombstone. A reader racing a move may miss the moved key (a
 * miss, never a wrong hit: every entry is written whole under its seqlock). */
static PyObject *Writer_remove_many(Writer *self, PyObject *keys)
{
    if (!ready(self))
        return NULL;
    PyObject *seq = checked_keys(keys);
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), removed = 0;
    uint64_t mask = self->mask;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key[4], unused;
        key_words(PySequence_Fast_GET_ITEM(seq, k), key);
        Py_ssize_t found = find(self, key, &unused);
        if (found < 0)
            continue;
        uint64_t i = (uint64_t)found, j = i;
        for (;;) {
            j = (j + 1) & mask;
            if (!self->used[j])
                break;
            uint64_t h = home(self->keys[j], self->bits);
            if (((j - h) & mask) >= ((j - i) & mask)) {   /* j's key may live at i: move it */
                const uint64_t *from = self->table + j * ENTRY_WORDS;
                memcpy(self->keys[i], self->keys[j], 32);
                write_entry(self->table + i * ENTRY_WORDS, from[0] & LOCATION_MASK, from[1],
                            self->keys[i]);
                i = j;
            }
        }
        self->used[i] = 0;
        memset(self->keys[i], 0, 32);
        write_entry(self->table + i * ENTRY_WORDS, EMPTY, 0, NULL);
        self->published--;
        removed++;
    }
    if (removed)
        publish_count(self);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static int one_key(PyObject *arg, uint64_t key[4])
{
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) != 32) {
        PyErr_SetString(PyExc_ValueError, "key: not 32 bytes (namespace + block hash)");
        return 0;
    }
    key_words(arg, key);
    return 1;
}

static PyObject *Writer_entry_of(Writer *self, PyObject *arg)
{
    uint64_t key[4], unused;
    if (!ready(self) || !one_key(arg, key))
        return NULL;
    Py_ssize_t j = find(self, key, &unused);
    if (j < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(j);
}

static PyObject *Writer_location(Writer *self, PyObject *arg)
{
    uint64_t key[4], unused;
    if (!ready(self) || !one_key(arg, key))
        return NULL;
    Py_ssize_t j = find(self, key, &unused);
    return PyLong_FromUnsignedLongLong(j < 0 ? EMPTY : self->table[j * ENTRY_WORDS] & LOCATION_MASK);
}

static PyObject *Writer_get_published(Writer *self, void *unused)
{
    return PyLong_FromSsize_t(self->published);
}

static PyObject *Writer_get_unpublished(Writer *self, void *unused)
{
    return PyLong_FromSsize_t(self->unpublished);
}

static PyMethodDef Writer_methods[] = {
    {"put_many", (PyCFunction)Writer_put_many, METH_VARARGS,
     "put_many(keys, location, refs=None) -> published: each 32-byte key at location with its "
     "ref (refs None: 0); a new key past the limit is counted in unpublished."},
    {"remove_many", (PyCFunction)Writer_remove_many, METH_O,
     "remove_many(keys): withdraw the published ones, shifting their clusters back."},
    {"entry_of", (PyCFunction)Writer_entry_of, METH_O,
     "entry_of(key) -> the entry holding key, or None."},
    {"location", (PyCFunction)Writer_location, METH_O,
     "location(key) -> what key's entry says now (0, EMPTY, where unpublished)."},
    {"prefault", (PyCFunction)Writer_prefault, METH_NOARGS,
     "prefault(): map every page of the table and its mirror now, without the GIL (a thread's "
     "job at start), so that no put takes a page fault."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS,
     "close(): let go of the segment's buffer (the mapping can then be closed)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Writer_getset[] = {
    {"published", (getter)Writer_get_published, NULL, "keys published now", NULL},
    {"unpublished", (getter)Writer_get_unpublished, NULL, "new keys refused at the limit", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool.daemon._index_writer.Writer",
    .tp_doc = "Writer(segment, capacity, limit): the writer of one mapped index segment.",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_index_writer",
    "The shared-memory index's writer, compiled (daemon/index_entries.py is the reference).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__index_writer(void)
{
    if (PyType_Ready(&WriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&WriterType);
    if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
