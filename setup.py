"""The compiled pieces: the shared-memory index's probe (client/_index_probe.c), its writer
(daemon/_index_writer.c), the pool's slot records (daemon/_pool_records.c) and the daemon's
in-memory slot record with its passes (daemon/_slot_record.c) and its LRU queue
(daemon/_lru.c). Optional: where they do not build (no C compiler), the install goes on, the
reader uses numpy, the daemon writes the index in Python, its records with numpy, keeps its
slots as dataclasses and its queues in OrderedDicts."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvpool.client._index_probe", ["client/_index_probe.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._index_writer", ["daemon/_index_writer.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._pool_records", ["daemon/_pool_records.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._slot_record", ["daemon/_slot_record.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._lru", ["daemon/_lru.c"],
              extra_compile_args=["-O2"], optional=True),
])
