/* The LRU queue of evictable slot ids (daemon/eviction.py's LruPolicy) as a linked list over
 * two arrays indexed by slot id, in C.
 *
 * Why: slot ids are dense (extent * records per extent + index), so a queue needs no hash
 * table. The OrderedDict it replaces spent a hash probe, a dict entry and a list node per
 * insert and per removal, each a cache miss on a queue of 65,536 slots: ~8% of a cold store
 * job's event-loop work (bench/investigations/store_job_ab.py). Here an insert, a removal and
 * a move to the back change a few array cells, and the victims a store takes from the head are
 * consecutive cells of the list it then unlinks.
 *
 * The same behaviour as the OrderedDict, which stays the fallback: inserting a queued id keeps
 * its place, ``touch`` moves a queued id to the back, ``remove`` of an absent id is a no-op,
 * ``remove_many`` of an absent one raises KeyError. ``examined`` counts the entries queries
 * looked at.
 *
 * The arrays are sized once where the queue is made with a capacity (the pool's slot ids), else
 * they grow to the largest id inserted. ``next`` holds each link plus 2, so that memory the
 * allocator hands out zeroed reads "not queued" without being written: filling it in at each
 * growth held the GIL for ~4 ms at a million ids (this VM), inside a store's commits, and a
 * block-outermost store whose commits grew the queue ran ~10% slower (one H100, issue 36). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define ABSENT (-2)   /* next of an id that is not queued */
#define END (-1)      /* next / prev of the last / first id, or an empty queue's head */

/* next[id] as stored (the link plus 2: zeroed memory is ABSENT) */
#define NEXT(q, id) ((q)->next[id] - 2)
#define SET_NEXT(q, id, v) ((q)->next[id] = (v) + 2)

typedef struct {
    PyObject_HEAD
    int64_t *next;
    int64_t *prev;
    Py_ssize_t capacity;   /* ids [0, capacity) have cells */
    Py_ssize_t length;
    int64_t head, tail;
    long long examined;
} LruObject;

static PyObject *lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    LruObject *q = (LruObject *)type->tp_alloc(type, 0);
    if (q != NULL)
        q->head = q->tail = END;
    return (PyObject *)q;
}

static int lru_init(LruObject *q, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", kwlist, &capacity))
        return -1;
    if (capacity < 0 || capacity > 0x100000000LL) {
        PyErr_Format(PyExc_ValueError, "a capacity of %zd ids is outside [0, 2**32]", capacity);
        return -1;
    }
    PyMem_Free(q->next);
    PyMem_Free(q->prev);
    q->next = q->prev = NULL;
    q->capacity = q->length = 0;
    q->head = q->tail = END;
    q->examined = 0;
    if (capacity) {
        q->next = PyMem_Calloc(capacity, sizeof(int64_t));
        q->prev = PyMem_Malloc(sizeof(int64_t) * capacity);
        if (q->next == NULL || q->prev == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        q->capacity = capacity;
    }
    return 0;
}

static void lru_dealloc(LruObject *q)
{
    PyMem_Free(q->next);
    PyMem_Free(q->prev);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* the id in ``o``: a slot id is an int in [0, 2**32) */
static int read_id(PyObject *o, int64_t *id)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "slot id %lld is outside [0, 2**32)", v);
        return -1;
    }
    *id = v;
    return 0;
}

static int grow(LruObject *q, int64_t id)
{
    if (id < q->capacity)
        return 0;
    Py_ssize_t cap = q->capacity ? q->capacity : 1024;
    while (cap <= id)
        cap *= 2;
    /* zeroed (ABSENT) past the old cells without writing them */
    int64_t *next = PyMem_Calloc(cap, sizeof(int64_t));
    if (next == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (q->capacity)
        memcpy(next, q->next, sizeof(int64_t) * q->capacity);
    PyMem_Free(q->next);
    q->next = next;
    int64_t *prev = PyMem_Realloc(q->prev, sizeof(int64_t) * cap);
    if (prev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    q->prev = prev;
    q->capacity = cap;
    return 0;
}

static inline int queued(LruObject *q, int64_t id)
{
    return id < q->capacity && NEXT(q, id) != ABSENT;
}

static inline void link_back(LruObject *q, int64_t id)
{
    q->prev[id] = q->tail;
    SET_NEXT(q, id, END);
    if (q->tail == END)
        q->head = id;
    else
        SET_NEXT(q, q->tail, id);
    q->tail = id;
    q->length++;
}

static inline void unlink_id(LruObject *q, int64_t id)
{
    int64_t p = q->prev[id], n = NEXT(q, id);
    if (p == END)
        q->head = n;
    else
        SET_NEXT(q, p, n);
    if (n == END)
        q->tail = p;
    else
        q->prev[n] = p;
    SET_NEXT(q, id, ABSENT);
    q->length--;
}

/* insert: queued ids keep their place (an OrderedDict's item assignment) */
static int insert_one(LruObject *q, PyObject *o)
{
    int64_t id;
    if (read_id(o, &id) < 0 || grow(q, id) < 0)
        return -1;
    if (NEXT(q, id) == ABSENT)
        link_back(q, id);
    return 0;
}

static int touch_one(LruObject *q, PyObject *o)
{
    int64_t id;
    if (read_id(o, &id) < 0)
        return -1;
    if (queued(q, id) && q->tail != id) {
        unlink_id(q, id);
        link_back(q, id);
    }
    return 0;
}

/* remove_one: absent ids are fine where ``strict`` is 0, a KeyError where it is 1 */
static int remove_one(LruObject *q, PyObject *o, int strict)
{
    int64_t id;
    if (read_id(o, &id) < 0)
        return -1;
    if (queued(q, id))
        unlink_id(q, id);
    else if (strict) {
        PyErr_SetObject(PyExc_KeyError, o);
        return -1;
    }
    return 0;
}

/* each item of ``items`` through ``one`` */
static PyObject *for_each(LruObject *q, PyObject *items, int (*one)(LruObject *, PyObject *))
{
    PyObject *it = PyObject_GetIter(items);
    if (it == NULL)
        return NULL;
    PyObject *o;
    while ((o = PyIter_Next(it)) != NULL) {
        int rc = one(q, o);
        Py_DECREF(o);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static int remove_strict(LruObject *q, PyObject *o) { return remove_one(q, o, 1); }

static PyObject *lru_insert(LruObject *q, PyObject *o)
{
    return insert_one(q, o) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *lru_insert_many(LruObject *q, PyObject *items)
{
    return for_each(q, items, insert_one);
}

static PyObject *lru_touch(LruObject *q, PyObject *o)
{
    return touch_one(q, o) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *lru_touch_many(LruObject *q, PyObject *items)
{
    return for_each(q, items, touch_one);
}

static PyObject *lru_remove(LruObject *q, PyObject *o)
{
    return remove_one(q, o, 0) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *lru_remove_many(LruObject *q, PyObject *items)
{
    return for_each(q, items, remove_strict);
}

/* the first n ids from the head, oldest first */
static PyObject *head_ids(LruObject *q, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    int64_t id = q->head;
    for (Py_ssize_t i = 0; i < n; i++, id = NEXT(q, id)) {
        PyObject *v = PyLong_FromLongLong(id);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* every queued id, oldest first, as native int64s in a bytes: no int object per id (the KV
 * event feed's announcement reads a whole size's queue, hundreds of thousands of ids) */
static PyObject *lru_order(LruObject *q, PyObject *unused)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, q->length * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    int64_t *at = (int64_t *)PyBytes_AS_STRING(out);
    int64_t id = q->head;
    for (Py_ssize_t i = 0; i < q->length; i++, id = NEXT(q, id))
        at[i] = id;
    return out;
}

static PyObject *lru_victims(LruObject *q, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    n = n < 0 ? 0 : (n > q->length ? q->length : n);
    PyObject *out = head_ids(q, n);
    if (out != NULL)
        q->examined += n;
    return out;
}

static PyObject *lru_oldest(LruObject *q, PyObject *unused)
{
    if (q->head == END)
        Py_RETURN_NONE;
    q->examined += 1;
    return PyLong_FromLongLong(q->head);
}

static PyObject *lru_iter(LruObject *q)
{
    PyObject *ids = head_ids(q, q->length);
    if (ids == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(ids);
    Py_DECREF(ids);
    return it;
}

static Py_ssize_t lru_len(LruObject *q)
{
    return q->length;
}

static int lru_contains(LruObject *q, PyObject *o)
{
    if (!PyLong_Check(o))
        return 0;
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return v >= 0 && queued(q, v);
}

static PyMethodDef lru_methods[] = {
    {"insert", (PyCFunction)lru_insert, METH_O, "slot became evictable: most recently used"},
    {"insert_many", (PyCFunction)lru_insert_many, METH_O, "insert of each, in order"},
    {"touch", (PyCFunction)lru_touch, METH_O, "a hit: most recently used (if queued)"},
    {"touch_many", (PyCFunction)lru_touch_many, METH_O, "touch of each, in order"},
    {"remove", (PyCFunction)lru_remove, METH_O, "no longer evictable (absent ids are fine)"},
    {"remove_many", (PyCFunction)lru_remove_many, METH_O,
     "remove of each (all queued: else KeyError)"},
    {"victims", (PyCFunction)lru_victims, METH_O,
     "up to n least recently used ids, oldest first; removes nothing"},
    {"oldest", (PyCFunction)lru_oldest, METH_NOARGS, "the least recently used id, or None"},
    {"order", (PyCFunction)lru_order, METH_NOARGS,
     "every queued id, oldest first, as native int64s (a bytes)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef lru_members[] = {
    {"examined", T_LONGLONG, offsetof(LruObject, examined), 0,
     "queue entries every query has looked at"},
    {"capacity", T_PYSSIZET, offsetof(LruObject, capacity), READONLY,
     "ids [0, capacity) have cells (the arrays grow past it)"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods lru_as_sequence = {
    .sq_length = (lenfunc)lru_len,
    .sq_contains = (objobjproc)lru_contains,
};

static PyTypeObject LruType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool.daemon._lru.LruPolicy",
    .tp_basicsize = sizeof(LruObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Evictable slot ids, least recently used first (daemon/eviction.py, in C).",
    .tp_new = lru_new,
    .tp_init = (initproc)lru_init,
    .tp_dealloc = (destructor)lru_dealloc,
    .tp_iter = (getiterfunc)lru_iter,
    .tp_as_sequence = &lru_as_sequence,
    .tp_methods = lru_methods,
    .tp_members = lru_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lru",
    "The LRU queue of evictable slot ids in C (see daemon/eviction.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lru(void)
{
    if (PyType_Ready(&LruType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "LruPolicy", (PyObject *)&LruType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
