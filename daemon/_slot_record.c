/* A pool slot's in-memory record as one C object, and the store and load paths' passes over a
 * batch of them: what daemon/slot_record.py's dataclass and Python passes do, where this was
 * built.
 *
 * Why: a store job on a full pool spends ~9 us of the event loop a slot when its slots are
 * cold (a copy just went through the caches), against ~1.6 warm (issue 36). A dataclass slot
 * keeps its ints as objects of their own (the ref, made anew at each claim; the id, the
 * offset), so each field read or written by the claim, the end of a store and the commit is
 * a pointer to chase and, for the ref, an int made and a cold one freed. Here the ints and the
 * deadline sit inline in the record, and each pass is one C loop over the batch with no
 * attribute dispatch. Python code reads and writes the same attribute names either way.
 *
 * Fields that may be any size stay objects: ``landed`` and ``writing`` are bit sets of units
 * (one per KV head: more than 64 for some models), ``owner`` and ``ticket`` are handed on as
 * they came. Every pass checks its whole batch before it changes anything. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>

#include "_key_shard.h"

typedef struct {
    PyObject_HEAD
    long long id;
    long long extent;
    long long index;
    long long offset;           /* pool byte offset of rank 0's shard */
    long long ref;              /* slot ref of the current generation (its upper half) */
    long long pins;
    long long reads;
    long long last_use;
    double deadline;
    int state;
    char doomed;
    char void_;
    PyObject *size_class;
    PyObject *ns;
    PyObject *key;
    PyObject *block_hash;
    PyObject *landed;
    PyObject *writing;
    PyObject *owner;
    PyObject *ticket;
} SlotObject;

static PyTypeObject SlotType;

#define AS_SLOT(o) ((SlotObject *)(o))

static int slot_traverse(SlotObject *s, visitproc visit, void *arg)
{
    Py_VISIT(s->size_class);
    Py_VISIT(s->ns);
    Py_VISIT(s->key);
    Py_VISIT(s->block_hash);
    Py_VISIT(s->landed);
    Py_VISIT(s->writing);
    Py_VISIT(s->owner);
    Py_VISIT(s->ticket);
    return 0;
}

static int slot_clear(SlotObject *s)
{
    Py_CLEAR(s->size_class);
    Py_CLEAR(s->ns);
    Py_CLEAR(s->key);
    Py_CLEAR(s->block_hash);
    Py_CLEAR(s->landed);
    Py_CLEAR(s->writing);
    Py_CLEAR(s->owner);
    Py_CLEAR(s->ticket);
    return 0;
}

static void slot_dealloc(SlotObject *s)
{
    PyObject_GC_UnTrack(s);
    slot_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *zero, *empty_bytes;

/* A new record with the dataclass's defaults (every object field set: none reads NULL). */
static SlotObject *slot_alloc(PyTypeObject *type)
{
    SlotObject *s = (SlotObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->size_class = Py_NewRef(Py_None);
    s->ns = Py_NewRef(empty_bytes);
    s->key = Py_NewRef(empty_bytes);
    s->block_hash = Py_NewRef(empty_bytes);
    s->landed = Py_NewRef(zero);
    s->writing = Py_NewRef(zero);
    s->owner = Py_NewRef(zero);
    s->ticket = Py_NewRef(zero);
    return s;
}

static PyObject *slot_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    return (PyObject *)slot_alloc(type);
}

static void set_object(PyObject **field, PyObject *value)
{
    Py_SETREF(*field, Py_NewRef(value));
}

static int slot_init(SlotObject *s, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"id", "extent", "index", "offset", "size_class", "state", "ns",
                             "key", "block_hash", "ref", "pins", "reads", "landed", "writing",
                             "owner", "deadline", "last_use", "doomed", "void", "ticket", NULL};
    PyObject *size_class, *ns = empty_bytes, *key = empty_bytes, *block_hash = empty_bytes;
    PyObject *landed = zero, *writing = zero, *owner = zero, *ticket = zero;
    long long id, extent, index, offset, ref = 0, pins = 0, reads = 0, last_use = 0;
    double deadline = 0.0;
    int state = 0, doomed = 0, void_ = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLLLO|iSSSLLLOOOdLppO", kwlist, &id, &extent,
                                     &index, &offset, &size_class, &state, &ns, &key,
                                     &block_hash, &ref, &pins, &reads, &landed, &writing,
                                     &owner, &deadline, &last_use, &doomed, &void_, &ticket))
        return -1;
    s->id = id;
    s->extent = extent;
    s->index = index;
    s->offset = offset;
    s->ref = ref;
    s->pins = pins;
    s->reads = reads;
    s->last_use = last_use;
    s->deadline = deadline;
    s->state = state;
    s->doomed = (char)doomed;
    s->void_ = (char)void_;
    set_object(&s->size_class, size_class);
    set_object(&s->ns, ns);
    set_object(&s->key, key);
    set_object(&s->block_hash, block_hash);
    set_object(&s->landed, landed);
    set_object(&s->writing, writing);
    set_object(&s->owner, owner);
    set_object(&s->ticket, ticket);
    return 0;
}

static PyObject *slot_repr(SlotObject *s)
{
    return PyUnicode_FromFormat("Slot(id=%lld, extent=%lld, state=%d, ref=%#llx, pins=%lld, "
                                "doomed=%d, void=%d)", s->id, s->extent, s->state,
                                (unsigned long long)s->ref, s->pins, s->doomed, s->void_);
}

#define MEMBER(name, type, field) {name, type, offsetof(SlotObject, field), 0, NULL}

static PyMemberDef slot_members[] = {
    MEMBER("id", T_LONGLONG, id),
    MEMBER("extent", T_LONGLONG, extent),
    MEMBER("index", T_LONGLONG, index),
    MEMBER("offset", T_LONGLONG, offset),
    MEMBER("ref", T_LONGLONG, ref),
    MEMBER("pins", T_LONGLONG, pins),
    MEMBER("reads", T_LONGLONG, reads),
    MEMBER("last_use", T_LONGLONG, last_use),
    MEMBER("deadline", T_DOUBLE, deadline),
    MEMBER("state", T_INT, state),
    MEMBER("size_class", T_OBJECT_EX, size_class),
    MEMBER("ns", T_OBJECT_EX, ns),
    MEMBER("key", T_OBJECT_EX, key),
    MEMBER("block_hash", T_OBJECT_EX, block_hash),
    MEMBER("landed", T_OBJECT_EX, landed),
    MEMBER("writing", T_OBJECT_EX, writing),
    MEMBER("owner", T_OBJECT_EX, owner),
    MEMBER("ticket", T_OBJECT_EX, ticket),
    {NULL, 0, 0, 0, NULL},
};

/* doomed and void: any truth value may be assigned, as to the dataclass's fields */
static PyObject *get_flag(SlotObject *s, void *which)
{
    return PyBool_FromLong(which ? s->void_ : s->doomed);
}

static int set_flag(SlotObject *s, PyObject *value, void *which)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a slot's flags cannot be deleted");
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0)
        return -1;
    if (which)
        s->void_ = (char)truth;
    else
        s->doomed = (char)truth;
    return 0;
}

static PyObject *get_generation(SlotObject *s, void *closure)
{
    return PyLong_FromLongLong(s->ref >> 32);
}

static PyGetSetDef slot_getset[] = {
    {"doomed", (getter)get_flag, (setter)set_flag, "unreachable; freed when its last pin goes",
     NULL},
    {"void", (getter)get_flag, (setter)set_flag,
     "a ticket bound to no slot (duplicate, no room): never written", (void *)1},
    {"generation", (getter)get_generation, NULL, "the ref's upper half", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpool.daemon._slot_record.Slot",
    .tp_basicsize = sizeof(SlotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A pool slot's record (daemon/slot_record.py's Slot, in C).",
    .tp_new = slot_new,
    .tp_init = (initproc)slot_init,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_traverse = (traverseproc)slot_traverse,
    .tp_clear = (inquiry)slot_clear,
    .tp_repr = (reprfunc)slot_repr,
    .tp_members = slot_members,
    .tp_getset = slot_getset,
};

/* ---- batch helpers ------------------------------------------------------------------------ */

/* ``seq`` as a list or tuple of slots (a new reference): else a TypeError naming the first
 * item that is not one. */
static PyObject *slot_items(PyObject *seq, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, "the slots must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!Py_IS_TYPE(items[i], &SlotType)) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] is a %.100s, not a slot", what, i,
                         Py_TYPE(items[i])->tp_name);
            Py_DECREF(fast);
            return NULL;
        }
    }
    return fast;
}

/* ``seq`` as a list or tuple of ``n`` items (a new reference): else a clear error. */
static PyObject *items_for(PyObject *seq, Py_ssize_t n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, "a pass's per-slot values must be a sequence");
    if (fast != NULL && PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%zd %s for %zd slots", PySequence_Fast_GET_SIZE(fast),
                     what, n);
        Py_CLEAR(fast);
    }
    return fast;
}

/* ---- the passes --------------------------------------------------------------------------- */

PyDoc_STRVAR(make_slots_doc,
"make_slots(base, extent, first_offset, slot_bytes, size_class, generations) -> list\n\n"
"A fresh extent's slots: ids base.., offsets first_offset + i * slot_bytes, refs at the\n"
"recorded generations.");

static PyObject *make_slots(PyObject *self, PyObject *args)
{
    long long base, extent, first, slot_bytes;
    PyObject *size_class, *generations;
    if (!PyArg_ParseTuple(args, "LLLLOO!", &base, &extent, &first, &slot_bytes, &size_class,
                          &PyList_Type, &generations))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(generations);
    long long *gens = PyMem_Malloc(sizeof(long long) * (n ? n : 1));
    if (gens == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        gens[i] = PyLong_AsLongLong(PyList_GET_ITEM(generations, i));
        if (gens[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(gens);
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        SlotObject *s = slot_alloc(&SlotType);
        if (s == NULL) {
            Py_CLEAR(out);
            break;
        }
        s->id = base + i;
        s->extent = extent;
        s->index = i;
        s->offset = first + i * slot_bytes;
        s->ref = (gens[i] << 32) | (base + i);
        set_object(&s->size_class, size_class);
        PyList_SET_ITEM(out, i, (PyObject *)s);
    }
    PyMem_Free(gens);
    return out;
}

PyDoc_STRVAR(claim_doc,
"claim(slots, hashes, tickets, ns, state, owner, deadline, pin_units, pins, ref_limit)\n"
"-> list of generations\n\n"
"SlotTable.claim's pass: each slot's next generation (past ref_limit, the slot id again),\n"
"its state, key (ns + hash), owner, deadline, units in flight, pins and ticket (tickets: a\n"
"sequence, or None for none).");

static PyObject *claim(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *hashes_arg, *tickets_arg, *ns, *owner, *pin_units;
    int state;
    double deadline;
    long long pins;
    unsigned long long ref_limit;      /* 2**63 for 31-bit generations: past a long long */
    if (!PyArg_ParseTuple(args, "OOOSiOdOLK", &slots_arg, &hashes_arg, &tickets_arg, &ns,
                          &state, &owner, &deadline, &pin_units, &pins, &ref_limit))
        return NULL;
    PyObject *slots = slot_items(slots_arg, "slots"), *hashes = NULL, *tickets = NULL;
    PyObject *gens = NULL, **keys = NULL;
    Py_ssize_t n = 0, made = 0;
    if (slots == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(slots);
    hashes = items_for(hashes_arg, n, "hashes");
    if (hashes == NULL)
        goto fail;
    if (tickets_arg != Py_None && (tickets = items_for(tickets_arg, n, "tickets")) == NULL)
        goto fail;
    PyObject **slot = PySequence_Fast_ITEMS(slots), **hash = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(hash[i])) {
            PyErr_Format(PyExc_TypeError, "hashes[%zd] is a %.100s, not bytes", i,
                         Py_TYPE(hash[i])->tp_name);
            goto fail;
        }
    }
    /* the keys and generations first: a failure to make one changes no slot */
    gens = PyList_New(n);
    keys = PyMem_Malloc(sizeof(PyObject *) * (n ? n : 1));
    if (gens == NULL || keys == NULL)
        goto fail;
    Py_ssize_t ns_len = PyBytes_GET_SIZE(ns);
    for (; made < n; made++) {
        Py_ssize_t h_len = PyBytes_GET_SIZE(hash[made]);
        PyObject *key = PyBytes_FromStringAndSize(NULL, ns_len + h_len);
        if (key == NULL)
            goto fail;
        memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(ns), ns_len);
        memcpy(PyBytes_AS_STRING(key) + ns_len, PyBytes_AS_STRING(hash[made]), h_len);
        keys[made] = key;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        unsigned long long ref = (unsigned long long)s->ref + (1ULL << 32);
        PyObject *g = PyLong_FromLongLong(ref < ref_limit ? (long long)(ref >> 32) : s->id >> 32);
        if (g == NULL)
            goto fail;
        PyList_SET_ITEM(gens, i, g);
    }
    PyObject **ticket = tickets ? PySequence_Fast_ITEMS(tickets) : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        unsigned long long ref = (unsigned long long)s->ref + (1ULL << 32);
        s->ref = ref < ref_limit ? (long long)ref : s->id;
        s->state = state;
        set_object(&s->ns, ns);
        Py_SETREF(s->key, keys[i]);
        set_object(&s->block_hash, hash[i]);
        set_object(&s->owner, owner);
        s->deadline = deadline;
        set_object(&s->writing, pin_units);
        s->pins = pins;
        set_object(&s->ticket, ticket ? ticket[i] : zero);
    }
    PyMem_Free(keys);
    Py_DECREF(slots);
    Py_DECREF(hashes);
    Py_XDECREF(tickets);
    return gens;
fail:
    if (keys != NULL) {
        while (made--)
            Py_DECREF(keys[made]);
        PyMem_Free(keys);
    }
    Py_XDECREF(gens);
    Py_DECREF(slots);
    Py_XDECREF(hashes);
    Py_XDECREF(tickets);
    return PyErr_Occurred() ? NULL : PyErr_NoMemory();
}

PyDoc_STRVAR(end_doc,
"end(slots, bit, ok, full, bound) -> (ready, doomed)\n\n"
"StorePath.end_store's pass: units bit no longer in flight and one pin less on each slot;\n"
"with ok, bit landed, and those now full (landed == full) are ready, their ticket's binding\n"
"taken out of bound (where it is still theirs); without ok, each is doomed. Returns the\n"
"ready slots and the doomed ones (for the caller to drop), in order.");

static PyObject *end(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *bit, *full, *bound;
    int ok;
    if (!PyArg_ParseTuple(args, "OOpOO!", &slots_arg, &bit, &ok, &full, &PyDict_Type, &bound))
        return NULL;
    PyObject *slots = slot_items(slots_arg, "slots");
    if (slots == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **slot = PySequence_Fast_ITEMS(slots);
    PyObject *not_bit = PyNumber_Invert(bit);
    PyObject *ready = PyList_New(0), *doomed = PyList_New(0);
    if (not_bit == NULL || ready == NULL || doomed == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        PyObject *writing = PyNumber_And(s->writing, not_bit);
        if (writing == NULL)
            goto fail;
        Py_SETREF(s->writing, writing);
        s->pins -= 1;
        if (!ok) {
            s->doomed = 1;
        } else if (!s->doomed) {
            PyObject *landed = PyNumber_Or(s->landed, bit);
            if (landed == NULL)
                goto fail;
            Py_SETREF(s->landed, landed);
            int is_full = PyObject_RichCompareBool(landed, full, Py_EQ);
            if (is_full < 0)
                goto fail;
            if (is_full) {
                if (PyList_Append(ready, slot[i]) < 0)
                    goto fail;
                PyObject *bound_to = PyDict_GetItemWithError(bound, s->ticket);
                if (bound_to == NULL && PyErr_Occurred())
                    goto fail;
                if (bound_to == slot[i] && PyDict_DelItem(bound, s->ticket) < 0)
                    goto fail;
                continue;
            }
        }
        if (s->doomed && PyList_Append(doomed, slot[i]) < 0)
            goto fail;
    }
    Py_DECREF(not_bit);
    Py_DECREF(slots);
    return Py_BuildValue("(NN)", ready, doomed);
fail:
    Py_XDECREF(not_bit);
    Py_XDECREF(ready);
    Py_XDECREF(doomed);
    Py_DECREF(slots);
    return NULL;
}

/* dict.pop(key, None) for a dict known to be a dict: 1 found, 0 absent, -1 error */
static int dict_discard(PyObject *dict, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyDict_DelItem(dict, key) < 0 ? -1 : 1;
}

PyDoc_STRVAR(commit_doc,
"commit(slots, tick, committed, writing, filling) -> list\n\n"
"SlotTable.commit's pass: each slot out of the writing (else the filling) map of slot id to\n"
"slot, in state committed, with no ticket, last used at tick. Returns the unpinned ones (to\n"
"be queued as evictable), in order.");

static PyObject *commit(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *writing, *filling;
    long long tick;
    int committed;
    if (!PyArg_ParseTuple(args, "OLiO!O!", &slots_arg, &tick, &committed, &PyDict_Type,
                          &writing, &PyDict_Type, &filling))
        return NULL;
    PyObject *slots = slot_items(slots_arg, "slots");
    if (slots == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **slot = PySequence_Fast_ITEMS(slots);
    PyObject *evictable = PyList_New(0);
    if (evictable == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        PyObject *id = PyLong_FromLongLong(s->id);
        if (id == NULL)
            goto fail;
        int found = dict_discard(writing, id);
        if (found == 0)
            found = dict_discard(filling, id);
        Py_DECREF(id);
        if (found < 0)
            goto fail;
        s->state = committed;
        set_object(&s->ticket, zero);
        s->last_use = tick;
        if (!s->pins && PyList_Append(evictable, slot[i]) < 0)
            goto fail;
    }
    Py_DECREF(slots);
    return evictable;
fail:
    Py_XDECREF(evictable);
    Py_DECREF(slots);
    return NULL;
}

PyDoc_STRVAR(evict_doc,
"evict(victims, free) -> list of ids\n\n"
"SlotTable.evict_many's pass over the victims whose space is free now: state free, nothing\n"
"landed. Returns their ids, in order.");

static PyObject *evict(PyObject *self, PyObject *args)
{
    PyObject *victims_arg;
    int free_state;
    if (!PyArg_ParseTuple(args, "Oi", &victims_arg, &free_state))
        return NULL;
    PyObject *victims = slot_items(victims_arg, "victims");
    if (victims == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(victims);
    PyObject **slot = PySequence_Fast_ITEMS(victims);
    PyObject *ids = PyList_New(n);
    for (Py_ssize_t i = 0; ids != NULL && i < n; i++) {
        PyObject *id = PyLong_FromLongLong(AS_SLOT(slot[i])->id);
        if (id == NULL)
            Py_CLEAR(ids);
        else
            PyList_SET_ITEM(ids, i, id);
    }
    if (ids != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            AS_SLOT(slot[i])->state = free_state;
            set_object(&AS_SLOT(slot[i])->landed, zero);
        }
    }
    Py_DECREF(victims);
    return ids;
}

PyDoc_STRVAR(record_lists_doc,
"record_lists(slots) -> (ids, keys, generations)\n\n"
"What the pool's records of a commit need, in one pass over the slots.");

static PyObject *record_lists(PyObject *self, PyObject *arg)
{
    PyObject *slots = slot_items(arg, "slots");
    if (slots == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **slot = PySequence_Fast_ITEMS(slots);
    PyObject *ids = PyList_New(n), *keys = PyList_New(n), *gens = PyList_New(n);
    if (ids == NULL || keys == NULL || gens == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        PyObject *id = PyLong_FromLongLong(s->id);
        if (id == NULL)
            goto fail;
        PyList_SET_ITEM(ids, i, id);
        PyList_SET_ITEM(keys, i, Py_NewRef(s->key));
        PyObject *g = PyLong_FromLongLong(s->ref >> 32);
        if (g == NULL)
            goto fail;
        PyList_SET_ITEM(gens, i, g);
    }
    Py_DECREF(slots);
    return Py_BuildValue("(NNN)", ids, keys, gens);
fail:
    Py_XDECREF(ids);
    Py_XDECREF(keys);
    Py_XDECREF(gens);
    Py_DECREF(slots);
    return NULL;
}

PyDoc_STRVAR(batch_of_doc,
"batch_of(slots) -> (ns, size_class, extent, read)\n\n"
"What a batch shares, in one pass: its namespace and its size class where every slot has the\n"
"same (else None), its extent where every slot sits in one (else -1), and how many of its\n"
"slots a lower tier is reading. A store's batch nearly always shares all three.");

static PyObject *batch_of(PyObject *self, PyObject *arg)
{
    PyObject *slots = slot_items(arg, "slots");
    if (slots == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **slot = PySequence_Fast_ITEMS(slots);
    PyObject *ns = NULL, *cls = NULL;
    long long extent = -1, read = 0;
    if (n) {
        SlotObject *first = AS_SLOT(slot[0]);
        ns = first->ns;
        cls = first->size_class;
        extent = first->extent;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        SlotObject *s = AS_SLOT(slot[i]);
        if (ns != NULL && s->ns != ns) {
            int same = PyObject_RichCompareBool(s->ns, ns, Py_EQ);
            if (same < 0) {
                Py_DECREF(slots);
                return NULL;
            }
            if (!same)
                ns = NULL;
        }
        if (s->size_class != cls)
            cls = NULL;
        if (s->extent != extent)
            extent = -1;
        read += s->reads > 0;
    }
    PyObject *out = Py_BuildValue("(OOLL)", ns ? ns : Py_None, cls ? cls : Py_None, extent,
                                  read);
    Py_DECREF(slots);
    return out;
}

/* ---- the load path's passes (a load job and the hits and leases before it) --------------- */

/* whether a mapped slot still holds its block for a reader: committed or filling, not doomed */
static inline int holds(SlotObject *s, int committed, int filling)
{
    return (s->state == committed || s->state == filling) && !s->doomed;
}

/* ``newest_use`` as a list with room for every slot's extent (checked before any change). */
static int check_extents(PyObject **slot, Py_ssize_t n, PyObject *newest_use)
{
    Py_ssize_t extents = PyList_GET_SIZE(newest_use);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long e = AS_SLOT(slot[i])->extent;
        if (e < 0 || e >= extents) {
            PyErr_Format(PyExc_IndexError, "slot %lld's extent %lld is not one of the %zd",
                         AS_SLOT(slot[i])->id, e, extents);
            return -1;
        }
    }
    return 0;
}

/* A batch that a pass stamps with a use: its slots (checked, their extents too) and the
 * tick as an int, for each extent's newest_use. */
typedef struct {
    PyObject *slots;
    PyObject **slot;
    Py_ssize_t n;
    PyObject *tick;
} Stamping;

static int stamping_open(Stamping *st, PyObject *slots_arg, long long tick,
                         PyObject *newest_use)
{
    st->tick = NULL;
    st->slots = slot_items(slots_arg, "slots");
    if (st->slots == NULL)
        return -1;
    st->n = PySequence_Fast_GET_SIZE(st->slots);
    st->slot = PySequence_Fast_ITEMS(st->slots);
    if (check_extents(st->slot, st->n, newest_use) < 0
            || (st->tick = PyLong_FromLongLong(tick)) == NULL) {
        Py_CLEAR(st->slots);
        return -1;
    }
    return 0;
}

static void stamping_close(Stamping *st)
{
    Py_CLEAR(st->tick);
    Py_CLEAR(st->slots);
}

/* A use at ``tick`` (a new reference to its int): the slot's and its extent's newest. */
static void stamp(SlotObject *s, long long tick, PyObject *tick_obj, PyObject *newest_use)
{
    s->last_use = tick;
    PyList_SetItem(newest_use, (Py_ssize_t)s->extent, Py_NewRef(tick_obj));
}

/* Extent e's row of ``rows`` (a list of each extent's slot list or None), borrowed; NULL
 * for an extent with none, and also -1 in *bad (with an exception set) where the row is
 * not a list. */
static PyObject *row_at(PyObject *rows, Py_ssize_t e, int *bad)
{
    PyObject *row = PyList_GET_ITEM(rows, e);
    if (row == Py_None)
        return NULL;
    if (!PyList_Check(row)) {
        PyErr_Format(PyExc_TypeError, "an extent's row is a %.100s, not a list",
                     Py_TYPE(row)->tp_name);
        *bad = -1;
        return NULL;
    }
    return row;
}

/* The slot of ``id`` in ``rows`` (a list of each extent's slot list or None; an id is its
 * extent times ``stride`` plus its index), borrowed; NULL where it names none. -1 in *bad
 * (with an exception set) where the rows are not such lists. */
static PyObject *slot_at(PyObject *rows, unsigned long long stride, unsigned long long id,
                         int *bad)
{
    unsigned long long e = id / stride, i = id % stride;
    if (e >= (unsigned long long)PyList_GET_SIZE(rows))
        return NULL;
    PyObject *row = row_at(rows, (Py_ssize_t)e, bad);
    if (row == NULL || i >= (unsigned long long)PyList_GET_SIZE(row))
        return NULL;
    PyObject *s = PyList_GET_ITEM(row, i);
    return s == Py_None ? NULL : s;
}

static int check_stride(long long stride)
{
    if (stride <= 0) {
        PyErr_SetString(PyExc_ValueError, "the stride must be positive");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(slots_of_doc,
"slots_of(rows, stride, ids) -> list\n\n"
"The slots of ids (rows: each extent's slots by index, an id being its extent times stride\n"
"plus its index); KeyError for an id that names none.");

static PyObject *slots_of(PyObject *self, PyObject *args)
{
    PyObject *rows, *ids_arg;
    long long stride;
    if (!PyArg_ParseTuple(args, "O!LO", &PyList_Type, &rows, &stride, &ids_arg)
            || check_stride(stride) < 0)
        return NULL;
    PyObject *ids = PySequence_Fast(ids_arg, "the ids must be a sequence");
    if (ids == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **id = PySequence_Fast_ITEMS(ids);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int bad = 0;
        PyObject *s = NULL;
        if (PyLong_Check(id[i])) {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(id[i], &overflow);
            if (v == -1 && PyErr_Occurred())
                goto fail;
            if (!overflow && v >= 0)
                s = slot_at(rows, (unsigned long long)stride, (unsigned long long)v, &bad);
            if (bad)
                goto fail;
        }
        if (s == NULL) {
            PyErr_SetObject(PyExc_KeyError, id[i]);
            goto fail;
        }
        PyList_SET_ITEM(out, i, Py_NewRef(s));
    }
    Py_DECREF(ids);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(ids);
    return NULL;
}

PyDoc_STRVAR(resolve_doc,
"resolve(refs, rows, stride, ns, committed, filling) -> (found, redo)\n\n"
"Index.resolve_load's first pass: per ref, the slot it names (rows, stride: as slots_of's)\n"
"while that slot still holds it (the same ref, committed or filling, not doomed, of ns), else\n"
"None; redo lists the indices of the Nones (0 refs too), for the caller's look by key.\n"
"Changes nothing.");

static PyObject *resolve(PyObject *self, PyObject *args)
{
    PyObject *refs_arg, *rows, *ns;
    long long stride;
    int committed, filling;
    if (!PyArg_ParseTuple(args, "OO!LOii", &refs_arg, &PyList_Type, &rows, &stride, &ns,
                          &committed, &filling) || check_stride(stride) < 0)
        return NULL;
    PyObject *refs = PySequence_Fast(refs_arg, "the refs must be a sequence");
    if (refs == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(refs);
    PyObject **ref = PySequence_Fast_ITEMS(refs);
    PyObject *found = PyList_New(n), *redo = PyList_New(0);
    if (found == NULL || redo == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(found, i, Py_NewRef(Py_None));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(ref[i])) {
            PyErr_Format(PyExc_TypeError, "refs[%zd] is a %.100s, not an int", i,
                         Py_TYPE(ref[i])->tp_name);
            goto fail;
        }
        /* the id is the ref's low 32 bits whatever its size (as ``ref & 0xFFFF_FFFF``); a
         * ref outside 0..2**63 names no slot's current generation */
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(ref[i], &overflow);
        if (value == -1 && PyErr_Occurred())
            goto fail;
        unsigned long long low = PyLong_AsUnsignedLongLongMask(ref[i]);
        if (low == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        PyObject *s = NULL;
        if (value != 0 || overflow) {
            int bad = 0;
            s = slot_at(rows, (unsigned long long)stride, low & 0xFFFFFFFFULL, &bad);
            if (bad)
                goto fail;
        }
        int held = 0;
        if (s != NULL && !overflow && Py_IS_TYPE(s, &SlotType)) {
            SlotObject *slot = AS_SLOT(s);
            held = slot->ref == value && holds(slot, committed, filling);
            if (held && slot->ns != ns) {
                held = PyObject_RichCompareBool(slot->ns, ns, Py_EQ);
                if (held < 0)
                    goto fail;
            }
        }
        if (held) {
            if (PyList_SetItem(found, i, Py_NewRef(s)) < 0)
                goto fail;
        } else {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(redo, at) < 0) {
                Py_XDECREF(at);
                goto fail;
            }
            Py_DECREF(at);
        }
    }
    Py_DECREF(refs);
    return Py_BuildValue("(NN)", found, redo);
fail:
    Py_XDECREF(found);
    Py_XDECREF(redo);
    Py_DECREF(refs);
    return NULL;
}

PyDoc_STRVAR(leading_doc,
"leading(shards, keys, committed, filling) -> (run, refs)\n\n"
"Index.lookup's walk of one key list: the slots (shards: a key table's dicts, block hash ->\n"
"slot, daemon/key_table.py) of its keys from the first on while each is held (committed or\n"
"filling, not doomed), and their refs. Changes nothing.");

static PyObject *leading(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys_arg;
    int committed, filling;
    if (!PyArg_ParseTuple(args, "O!Oii", &PyTuple_Type, &shards, &keys_arg, &committed,
                          &filling))
        return NULL;
    if (key_shards_check(shards) < 0)
        return NULL;
    PyObject *keys = PySequence_Fast(keys_arg, "the keys must be a sequence");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **key = PySequence_Fast_ITEMS(keys);
    PyObject *run = PyList_New(0), *refs = PyList_New(0);
    if (run == NULL || refs == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % 64 == 0)
            key_shards_prefetch(shards, key + i, n - i);
        PyObject *shard = key_shard(shards, key[i]);
        if (shard == NULL)
            goto fail;
        PyObject *s = PyDict_GetItemWithError(shard, key[i]);
        if (s == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (!Py_IS_TYPE(s, &SlotType)) {
            PyErr_Format(PyExc_TypeError, "the table holds a %.100s, not a slot",
                         Py_TYPE(s)->tp_name);
            goto fail;
        }
        SlotObject *slot = AS_SLOT(s);
        if (!holds(slot, committed, filling))
            break;
        PyObject *ref = PyLong_FromLongLong(slot->ref);
        if (ref == NULL || PyList_Append(run, s) < 0 || PyList_Append(refs, ref) < 0) {
            Py_XDECREF(ref);
            goto fail;
        }
        Py_DECREF(ref);
    }
    Py_DECREF(keys);
    return Py_BuildValue("(NN)", run, refs);
fail:
    Py_XDECREF(run);
    Py_XDECREF(refs);
    Py_DECREF(keys);
    return NULL;
}

PyDoc_STRVAR(pin_doc,
"pin(slots, tick, newest_use, committed) -> list\n\n"
"SlotTable.pin's pass: one pin more on each slot, each used at tick (its last_use and its\n"
"extent's newest_use). Returns those that left the queues (committed, not doomed, unpinned\n"
"until now), in order.");

static PyObject *pin(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *newest_use;
    long long tick;
    int committed;
    Stamping st;
    if (!PyArg_ParseTuple(args, "OLO!i", &slots_arg, &tick, &PyList_Type, &newest_use,
                          &committed) || stamping_open(&st, slots_arg, tick, newest_use) < 0)
        return NULL;
    PyObject *left = PyList_New(0);
    for (Py_ssize_t i = 0; left != NULL && i < st.n; i++) {
        SlotObject *s = AS_SLOT(st.slot[i]);
        if (!s->pins && s->state == committed && !s->doomed
                && PyList_Append(left, st.slot[i]) < 0)
            Py_CLEAR(left);
        s->pins += 1;
        stamp(s, tick, st.tick, newest_use);
    }
    stamping_close(&st);
    return left;
}

PyDoc_STRVAR(unpin_doc,
"unpin(slots, tick, newest_use, committed, free, draining) -> (evictable, to_free)\n\n"
"SlotTable.unpin's pass: one pin less on each slot. Of those whose last pin went and that are\n"
"not free: the doomed ones and the committed ones of a draining extent (draining: extent ->\n"
"its new size) are to be freed; the other committed ones are used at tick and evictable\n"
"again. Both in order.");

static PyObject *unpin(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *newest_use, *draining;
    long long tick;
    int committed, free_state;
    Stamping st;
    if (!PyArg_ParseTuple(args, "OLO!iiO!", &slots_arg, &tick, &PyList_Type, &newest_use,
                          &committed, &free_state, &PyDict_Type, &draining)
            || stamping_open(&st, slots_arg, tick, newest_use) < 0)
        return NULL;
    PyObject *evictable = PyList_New(0), *to_free = PyList_New(0);
    if (evictable == NULL || to_free == NULL)
        goto fail;
    int any_draining = PyDict_GET_SIZE(draining) > 0;
    for (Py_ssize_t i = 0; i < st.n; i++) {
        SlotObject *s = AS_SLOT(st.slot[i]);
        s->pins -= 1;
        if (s->pins || s->state == free_state)
            continue;
        int drains = 0;
        if (s->state == committed && any_draining) {
            PyObject *extent = PyLong_FromLongLong(s->extent);
            if (extent == NULL)
                goto fail;
            drains = PyDict_Contains(draining, extent);
            Py_DECREF(extent);
            if (drains < 0)
                goto fail;
        }
        if (s->doomed || drains) {
            if (PyList_Append(to_free, st.slot[i]) < 0)
                goto fail;
        } else if (s->state == committed) {
            stamp(s, tick, st.tick, newest_use);
            if (PyList_Append(evictable, st.slot[i]) < 0)
                goto fail;
        }
    }
    stamping_close(&st);
    return Py_BuildValue("(NN)", evictable, to_free);
fail:
    Py_XDECREF(evictable);
    Py_XDECREF(to_free);
    stamping_close(&st);
    return NULL;
}

PyDoc_STRVAR(touch_doc,
"touch(slots, tick, newest_use) -> list\n\n"
"SlotTable.touch's pass: each slot used at tick. Returns the unpinned ones (queued: to be\n"
"made most recently used there), in order.");

static PyObject *touch(PyObject *self, PyObject *args)
{
    PyObject *slots_arg, *newest_use;
    long long tick;
    Stamping st;
    if (!PyArg_ParseTuple(args, "OLO!", &slots_arg, &tick, &PyList_Type, &newest_use)
            || stamping_open(&st, slots_arg, tick, newest_use) < 0)
        return NULL;
    PyObject *queued = PyList_New(0);
    for (Py_ssize_t i = 0; queued != NULL && i < st.n; i++) {
        SlotObject *s = AS_SLOT(st.slot[i]);
        stamp(s, tick, st.tick, newest_use);
        if (!s->pins && PyList_Append(queued, st.slot[i]) < 0)
            Py_CLEAR(queued);
    }
    stamping_close(&st);
    return queued;
}

PyDoc_STRVAR(held_count_doc,
"held_count(rows, committed) -> int\n\n"
"SlotTable.pinned_count's pass: how many slots of rows (each extent's slot list, or None)\n"
"are committed and pinned or read.");

static PyObject *held_count(PyObject *self, PyObject *args)
{
    PyObject *rows;
    int committed;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &rows, &committed))
        return NULL;
    long long n = 0;
    for (Py_ssize_t e = 0; e < PyList_GET_SIZE(rows); e++) {
        int bad = 0;
        PyObject *row = row_at(rows, e, &bad);
        if (bad)
            return NULL;
        if (row == NULL)
            continue;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(row); i++) {
            PyObject *o = PyList_GET_ITEM(row, i);
            if (!Py_IS_TYPE(o, &SlotType))
                continue;           /* a gap */
            SlotObject *slot = AS_SLOT(o);
            n += slot->state == committed && (slot->pins > 0 || slot->reads > 0);
        }
    }
    return PyLong_FromLongLong(n);
}

/* whether a slot's namespace is ns (a bytes): the same object in the common case */
static inline int of_ns(SlotObject *s, PyObject *ns)
{
    PyObject *mine = s->ns;
    return mine == ns || (PyBytes_Check(mine) && PyBytes_GET_SIZE(mine) == PyBytes_GET_SIZE(ns)
                          && memcmp(PyBytes_AS_STRING(mine), PyBytes_AS_STRING(ns),
                                    (size_t)PyBytes_GET_SIZE(ns)) == 0);
}

PyDoc_STRVAR(of_namespace_doc,
"of_namespace(rows, stride, order, ns) -> list\n\n"
"The slots named by order (a buffer of native int64 ids, as an LRU queue's order()) whose\n"
"namespace is ns, in that order. rows, stride: as slots_of's; KeyError for an id that names\n"
"no slot.");

static PyObject *of_namespace(PyObject *self, PyObject *args)
{
    PyObject *rows, *ns;
    long long stride;
    Py_buffer order;
    if (!PyArg_ParseTuple(args, "O!Ly*O!", &PyList_Type, &rows, &stride, &order,
                          &PyBytes_Type, &ns))
        return NULL;
    PyObject *out = NULL;
    if (check_stride(stride) < 0)
        goto done;
    if (order.len % (Py_ssize_t)sizeof(long long) != 0) {
        PyErr_SetString(PyExc_ValueError, "the order is not a whole number of int64 ids");
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL)
        goto done;
    const long long *id = (const long long *)order.buf;
    Py_ssize_t n = order.len / (Py_ssize_t)sizeof(long long);
    for (Py_ssize_t i = 0; i < n; i++) {
        int bad = 0;
        PyObject *o = id[i] < 0 ? NULL
            : slot_at(rows, (unsigned long long)stride, (unsigned long long)id[i], &bad);
        if (bad)
            goto fail;
        if (o == NULL || !Py_IS_TYPE(o, &SlotType)) {
            PyObject *v = PyLong_FromLongLong(id[i]);
            if (v != NULL) {
                PyErr_SetObject(PyExc_KeyError, v);
                Py_DECREF(v);
            }
            goto fail;
        }
        SlotObject *slot = AS_SLOT(o);
        if (of_ns(slot, ns) && PyList_Append(out, o) < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&order);
    return out;
}

PyDoc_STRVAR(committed_hashes_doc,
"committed_hashes(rows, ns, committed) -> list\n\n"
"The block hashes of the slots of rows (each extent's slot list, or None) of namespace ns\n"
"that are committed and not doomed, in slot order.");

static PyObject *committed_hashes(PyObject *self, PyObject *args)
{
    PyObject *rows, *ns;
    int committed;
    if (!PyArg_ParseTuple(args, "O!O!i", &PyList_Type, &rows, &PyBytes_Type, &ns, &committed))
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t e = 0; e < PyList_GET_SIZE(rows); e++) {
        int bad = 0;
        PyObject *row = row_at(rows, e, &bad);
        if (bad) {
            Py_DECREF(out);
            return NULL;
        }
        if (row == NULL)
            continue;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(row); i++) {
            PyObject *o = PyList_GET_ITEM(row, i);
            if (!Py_IS_TYPE(o, &SlotType))
                continue;           /* a gap */
            SlotObject *slot = AS_SLOT(o);
            if (slot->state == committed && !slot->doomed && of_ns(slot, ns)
                    && PyList_Append(out, slot->block_hash) < 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
    }
    return out;
}

PyDoc_STRVAR(offsets_doc,
"offsets(slots) -> bytearray\n\n"
"Each slot's pool offset as native int64s, in order (numpy.frombuffer reads them).");

static PyObject *offsets(PyObject *self, PyObject *arg)
{
    PyObject *slots = slot_items(arg, "slots");
    if (slots == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    PyObject **slot = PySequence_Fast_ITEMS(slots);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(long long));
    if (out != NULL) {
        long long *at = (long long *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            at[i] = AS_SLOT(slot[i])->offset;
    }
    Py_DECREF(slots);
    return out;
}

static PyMethodDef methods[] = {
    {"make_slots", make_slots, METH_VARARGS, make_slots_doc},
    {"claim", claim, METH_VARARGS, claim_doc},
    {"end", end, METH_VARARGS, end_doc},
    {"commit", commit, METH_VARARGS, commit_doc},
    {"evict", evict, METH_VARARGS, evict_doc},
    {"batch_of", batch_of, METH_O, batch_of_doc},
    {"record_lists", record_lists, METH_O, record_lists_doc},
    {"resolve", resolve, METH_VARARGS, resolve_doc},
    {"slots_of", slots_of, METH_VARARGS, slots_of_doc},
    {"leading", leading, METH_VARARGS, leading_doc},
    {"pin", pin, METH_VARARGS, pin_doc},
    {"unpin", unpin, METH_VARARGS, unpin_doc},
    {"touch", touch, METH_VARARGS, touch_doc},
    {"offsets", offsets, METH_O, offsets_doc},
    {"held_count", held_count, METH_VARARGS, held_count_doc},
    {"of_namespace", of_namespace, METH_VARARGS, of_namespace_doc},
    {"committed_hashes", committed_hashes, METH_VARARGS, committed_hashes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slot_record",
    "A pool slot's record and the store and load paths' passes over them, in C (see "
    "daemon/slot_record.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__slot_record(void)
{
    zero = PyLong_FromLong(0);
    empty_bytes = PyBytes_FromStringAndSize("", 0);
    if (zero == NULL || empty_bytes == NULL || PyType_Ready(&SlotType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Slot", (PyObject *)&SlotType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
