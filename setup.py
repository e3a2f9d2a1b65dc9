"""The compiled pieces: the shared-memory index's probe (client/_index_probe.c), its writer
(daemon/_index_writer.c), the pool's slot records (daemon/_pool_records.c) and the daemon's
in-memory slot record with its passes (daemon/_slot_record.c), its LRU queue (daemon/_lru.c)
and its key tables' passes (daemon/_key_table.c). Optional: where they do not build (no C
compiler), the install goes on, the reader uses numpy, the daemon writes the index in Python,
its records with numpy, keeps its slots as dataclasses, its queues in OrderedDicts and walks
its key tables in Python."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvpool.client._index_probe", ["client/_index_probe.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._index_writer", ["daemon/_index_writer.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._pool_records", ["daemon/_pool_records.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._slot_record", ["daemon/_slot_record.c"],
              depends=["daemon/_key_shard.h"], extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._lru", ["daemon/_lru.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._key_table", ["daemon/_key_table.c"],
              depends=["daemon/_key_shard.h"], extra_compile_args=["-O2"], optional=True),
])
