/* The pool's slot records, written in C: what daemon/pool.py's write_states and commit_records
 * do with numpy, one call per batch. A store job on a full pool writes records three times
 * (its victims FREE, its claims WRITING with their generations, its commits' keys) on the
 * event loop; numpy spends ~5 us of fixed cost per array it makes or indexes, ~15-25 us a
 * batch of 128 slots on a 2-core host, where these stores cost a few nanoseconds each.
 *
 * The record layout is daemon/pool.py's RECORD_DTYPE (the pool checks these offsets against
 * it at import); numpy stays the reference and the fallback where this module was not built.
 * Crash order as there: every key and generation of a batch is stored before any state byte
 * (a daemon killed in between leaves those records in their old state, which adoption reads).
 * On x86-64 the stores stay in program order; the signal fence keeps the compiler from
 * reordering them. Every id is checked before anything is written: a bad batch changes
 * nothing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define RECORD_BYTES 48
#define KEY_BYTES 32
#define GENERATION_OFFSET 32
#define STATE_OFFSET 36
#define STACK_IDS 1024

/* The table's records as bytes (a writable, contiguous buffer), released by the caller. */
static int get_table(PyObject *table, Py_buffer *view)
{
    if (PyObject_GetBuffer(table, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % RECORD_BYTES) {
        PyErr_Format(PyExc_ValueError, "a record table of %zd bytes is no whole number of "
                     "%d-byte records", view->len, RECORD_BYTES);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Each id of items[0..n) in [0, records), into out: else an IndexError. */
static int read_ids(PyObject **items, Py_ssize_t n, Py_ssize_t records, Py_ssize_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t id = PyLong_AsSsize_t(items[i]);
        if (id == -1 && PyErr_Occurred())
            return -1;
        if (id < 0 || id >= records) {
            PyErr_Format(PyExc_IndexError, "slot id %zd is outside the record table (%zd "
                         "records)", id, records);
            return -1;
        }
        out[i] = id;
    }
    return 0;
}

/* Each generation of items[0..n) as 32 bits, into out: else an OverflowError. */
static int read_generations(PyObject **items, Py_ssize_t n, uint32_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long g = PyLong_AsUnsignedLong(items[i]);
        if (g == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        if (g > UINT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "generation %lu does not fit 32 bits", g);
            return -1;
        }
        out[i] = (uint32_t)g;
    }
    return 0;
}

/* What one batch call holds: the table, the id and value sequences, and the ids and
 * generations read out of them (on the stack up to STACK_IDS). */
typedef struct {
    Py_buffer table;
    PyObject *ids, *keys, *generations;
    Py_ssize_t n;
    Py_ssize_t *slot, slot_stack[STACK_IDS];
    uint32_t *gen, gen_stack[STACK_IDS];
} Batch;

static void batch_release(Batch *b)
{
    if (b->slot && b->slot != b->slot_stack)
        PyMem_Free(b->slot);
    if (b->gen && b->gen != b->gen_stack)
        PyMem_Free(b->gen);
    Py_XDECREF(b->ids);
    Py_XDECREF(b->keys);
    Py_XDECREF(b->generations);
    if (b->table.obj)
        PyBuffer_Release(&b->table);
}

/* Reads and checks a batch: ids, then the keys and generations where given (None: none),
 * each as long as the ids. */
static int batch_read(Batch *b, PyObject *table, PyObject *ids, PyObject *keys,
                      PyObject *generations)
{
    memset(b, 0, offsetof(Batch, slot_stack));
    b->gen = NULL;
    if (get_table(table, &b->table) < 0)
        return -1;
    if (!(b->ids = PySequence_Fast(ids, "slot ids must be a sequence")))
        return -1;
    b->n = PySequence_Fast_GET_SIZE(b->ids);
    if (keys != Py_None && !(b->keys = PySequence_Fast(keys, "keys must be a sequence")))
        return -1;
    if (generations != Py_None
            && !(b->generations = PySequence_Fast(generations, "generations must be a sequence")))
        return -1;
    if ((b->keys && PySequence_Fast_GET_SIZE(b->keys) != b->n)
            || (b->generations && PySequence_Fast_GET_SIZE(b->generations) != b->n)) {
        PyErr_Format(PyExc_ValueError, "%zd slot ids, but not as many keys or generations",
                     b->n);
        return -1;
    }
    b->slot = b->n <= STACK_IDS ? b->slot_stack : PyMem_Malloc(b->n * sizeof(Py_ssize_t));
    if (!b->slot)
        return PyErr_NoMemory(), -1;
    if (read_ids(PySequence_Fast_ITEMS(b->ids), b->n, b->table.len / RECORD_BYTES, b->slot) < 0)
        return -1;
    if (b->generations) {
        b->gen = b->n <= STACK_IDS ? b->gen_stack : PyMem_Malloc(b->n * sizeof(uint32_t));
        if (!b->gen)
            return PyErr_NoMemory(), -1;
        if (read_generations(PySequence_Fast_ITEMS(b->generations), b->n, b->gen) < 0)
            return -1;
    }
    if (b->keys) {
        PyObject **items = PySequence_Fast_ITEMS(b->keys);
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (!PyBytes_Check(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY_BYTES) {
                PyErr_Format(PyExc_ValueError, "key %zd is not %d bytes", i, KEY_BYTES);
                return -1;
            }
    }
    return 0;
}

static int read_state(PyObject *state, uint8_t *out)
{
    long v = PyLong_AsLong(state);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > 255) {
        PyErr_Format(PyExc_ValueError, "state %ld is not a byte", v);
        return -1;
    }
    *out = (uint8_t)v;
    return 0;
}

/* The batch's keys and generations (where given), then, after the fence, its states. */
static void batch_write(const Batch *b, uint8_t state)
{
    uint8_t *rec = b->table.buf;
    PyObject **keys = b->keys ? PySequence_Fast_ITEMS(b->keys) : NULL;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        uint8_t *r = rec + b->slot[i] * RECORD_BYTES;
        if (keys)
            memcpy(r, PyBytes_AS_STRING(keys[i]), KEY_BYTES);
        if (b->gen)
            memcpy(r + GENERATION_OFFSET, &b->gen[i], 4);     /* little-endian, as the dtype */
    }
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t i = 0; i < b->n; i++)
        rec[b->slot[i] * RECORD_BYTES + STATE_OFFSET] = state;
}

/* One call's batch: read and checked whole, then written, or refused with nothing written. */
static PyObject *write_batch(PyObject *table, PyObject *ids, PyObject *keys,
                             PyObject *generations, uint8_t state)
{
    Batch b;
    int ok = batch_read(&b, table, ids, keys, generations) == 0;
    if (ok)
        batch_write(&b, state);
    batch_release(&b);
    return ok ? Py_NewRef(Py_None) : NULL;
}

PyDoc_STRVAR(write_states_doc,
"write_states(table, ids, state, generations=None)\n--\n\n"
"Records ids (slot ids: positions in table, the record table's bytes) set to state, their\n"
"generations first where given.");

static PyObject *write_states(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"table", "ids", "state", "generations", NULL};
    PyObject *table, *ids, *state_obj, *generations = Py_None;
    uint8_t state;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O", names, &table, &ids, &state_obj,
                                     &generations) || read_state(state_obj, &state) < 0)
        return NULL;
    return write_batch(table, ids, Py_None, generations, state);
}

PyDoc_STRVAR(commit_doc,
"commit(table, ids, keys, generations, state)\n--\n\n"
"Records ids set to hold keys (32 bytes each) at generations, then to state.");

static PyObject *commit(PyObject *self, PyObject *args)
{
    PyObject *table, *ids, *keys, *generations, *state_obj;
    uint8_t state;
    if (!PyArg_ParseTuple(args, "OOOOO", &table, &ids, &keys, &generations, &state_obj)
            || read_state(state_obj, &state) < 0)
        return NULL;
    if (keys == Py_None || generations == Py_None) {
        PyErr_SetString(PyExc_TypeError, "a commit names every key and generation");
        return NULL;
    }
    return write_batch(table, ids, keys, generations, state);
}

static PyMethodDef methods[] = {
    {"write_states", (PyCFunction)(void (*)(void))write_states, METH_VARARGS | METH_KEYWORDS,
     write_states_doc},
    {"commit", commit, METH_VARARGS, commit_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pool_records",
    "The pool's slot records written in C (see daemon/pool.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__pool_records(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0
              || PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0
              || PyModule_AddIntConstant(m, "GENERATION_OFFSET", GENERATION_OFFSET) < 0
              || PyModule_AddIntConstant(m, "STATE_OFFSET", STATE_OFFSET) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
