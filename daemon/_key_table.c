/* The batch passes of a namespace's key table (daemon/key_table.py): one C loop over a
 * job's hashes where Python would make a call per hash to reach each one's shard.
 *
 * A table is a tuple of SHARDS dicts; a key lives in the dict that the top byte of its hash
 * names (the dicts' own probes start from the low bits, so those stay spread). The Python
 * passes in key_table.py are the reference and the fallback; the two must agree on the shard
 * of every key. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_key_shard.h"

/* What a pass does with one key in its dict: 0 to go on, 1 to stop there, -1 on an error. */
typedef int (*key_step)(PyObject *shard, PyObject *key, Py_ssize_t i, void *with);

/* Run ``step`` over keys (any iterable) in order, their dicts asked for ahead. Returns what
 * the last step returned (0 when every key was stepped over), -1 on an error. */
static int walk(PyObject *shards, PyObject *keys_arg, key_step step, void *with)
{
    if (key_shards_check(shards) < 0)
        return -1;
    PyObject *keys = PySequence_Fast(keys_arg, "the keys must be a sequence");
    if (keys == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **key = PySequence_Fast_ITEMS(keys);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        if (i % 64 == 0)
            key_shards_prefetch(shards, key + i, n - i);
        PyObject *shard = key_shard(shards, key[i]);
        rc = shard == NULL ? -1 : step(shard, key[i], i, with);
    }
    Py_DECREF(keys);
    return rc;
}

static int find_step(PyObject *shard, PyObject *key, Py_ssize_t i, void *with)
{
    PyObject *v = PyDict_GetItemWithError(shard, key);
    if (v == NULL && PyErr_Occurred())
        return -1;
    return PyList_Append((PyObject *)with, v != NULL ? v : Py_None);
}

PyDoc_STRVAR(find_doc,
"find(shards, keys) -> list\n\n"
"Per key, the value the table maps it to, or None.");

static PyObject *find(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys, *out;
    if (!PyArg_ParseTuple(args, "OO", &shards, &keys) || (out = PyList_New(0)) == NULL)
        return NULL;
    if (walk(shards, keys, find_step, out) < 0)
        Py_CLEAR(out);
    return out;
}

struct values { Py_ssize_t n; PyObject **item; };

static int put_step(PyObject *shard, PyObject *key, Py_ssize_t i, void *with)
{
    struct values *values = with;
    if (i >= values->n)
        return 1;
    return PyDict_SetItem(shard, key, values->item[i]);
}

PyDoc_STRVAR(put_doc,
"put(shards, keys, values) -> None\n\n"
"Map each key to its value (as dict.update(zip(keys, values)): the shorter one ends it).");

static PyObject *put(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys, *values_arg;
    if (!PyArg_ParseTuple(args, "OOO", &shards, &keys, &values_arg))
        return NULL;
    PyObject *fast = PySequence_Fast(values_arg, "the values must be a sequence");
    if (fast == NULL)
        return NULL;
    struct values values = {PySequence_Fast_GET_SIZE(fast), PySequence_Fast_ITEMS(fast)};
    int rc = walk(shards, keys, put_step, &values);
    Py_DECREF(fast);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static int delete_step(PyObject *shard, PyObject *key, Py_ssize_t i, void *with)
{
    return PyDict_DelItem(shard, key);
}

PyDoc_STRVAR(delete_doc,
"delete(shards, keys) -> None\n\n"
"Unmap every key, in order; KeyError at the first the table does not hold (those before it\n"
"are gone).");

static PyObject *delete(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys;
    if (!PyArg_ParseTuple(args, "OO", &shards, &keys) || walk(shards, keys, delete_step, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int holds_step(PyObject *shard, PyObject *key, Py_ssize_t i, void *with)
{
    return PyDict_Contains(shard, key);
}

PyDoc_STRVAR(holds_any_doc,
"holds_any(shards, keys) -> bool\n\n"
"Whether the table maps any of keys.");

static PyObject *holds_any(PyObject *self, PyObject *args)
{
    PyObject *shards, *keys;
    if (!PyArg_ParseTuple(args, "OO", &shards, &keys))
        return NULL;
    int rc = walk(shards, keys, holds_step, NULL);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, find_doc},
    {"put", put, METH_VARARGS, put_doc},
    {"delete", delete, METH_VARARGS, delete_doc},
    {"holds_any", holds_any, METH_VARARGS, holds_any_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_key_table",
    "A namespace's key table's batch passes in C (see daemon/key_table.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__key_table(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "SHARDS", KEY_SHARDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
