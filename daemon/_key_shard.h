/* Which of a key table's dicts holds a key (daemon/key_table.py), and the prefetch of a
 * batch's dicts. Included by daemon/_key_table.c and daemon/_slot_record.c, the two C walks
 * of a key table. */
#ifndef KVPOOL_KEY_SHARD_H
#define KVPOOL_KEY_SHARD_H

#define KEY_SHARD_BITS 8
#define KEY_SHARDS (1 << KEY_SHARD_BITS)

/* The dict of ``shards`` (a tuple of KEY_SHARDS) that holds ``key`` (borrowed): the top byte
 * of its hash, as key_table.shard_index reads it. NULL with an exception set. */
static PyObject *key_shard(PyObject *shards, PyObject *key)
{
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1)
        return NULL;
    PyObject *shard = PyTuple_GET_ITEM(shards,
                                       (size_t)h >> (8 * sizeof(Py_hash_t) - KEY_SHARD_BITS));
    if (!PyDict_CheckExact(shard)) {
        PyErr_Format(PyExc_TypeError, "a key table's shard is a %.100s, not a dict",
                     Py_TYPE(shard)->tp_name);
        return NULL;
    }
    return shard;
}

static int key_shards_check(PyObject *shards)
{
    if (!PyTuple_CheckExact(shards) || PyTuple_GET_SIZE(shards) != KEY_SHARDS) {
        PyErr_Format(PyExc_TypeError, "the shards must be a tuple of %d dicts", KEY_SHARDS);
        return -1;
    }
    return 0;
}

/* Ask for the dicts (and then their key tables) that keys[0:n] will probe, before the probes:
 * after a copy has flushed the caches each is a miss, and one after the other they would
 * wait in turn, where one table with one dict had them warm after its first key. Hashes
 * bytes keys as their probes would (the hash is cached in the object); skips the rest. */
static void key_shards_prefetch(PyObject *shards, PyObject **key, Py_ssize_t n)
{
    enum { AHEAD = 64 };
    PyDictObject *dicts[AHEAD];
    if (n > AHEAD)
        n = AHEAD;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(key[i]))
            continue;
        Py_hash_t h = PyObject_Hash(key[i]);
        if (h == -1) {
            PyErr_Clear();      /* the probe itself will raise it */
            continue;
        }
        dicts[m] = (PyDictObject *)PyTuple_GET_ITEM(
            shards, (size_t)h >> (8 * sizeof(Py_hash_t) - KEY_SHARD_BITS));
        __builtin_prefetch(dicts[m]);
        m++;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (PyDict_CheckExact((PyObject *)dicts[i]))
            __builtin_prefetch(dicts[i]->ma_keys);
}

#endif
