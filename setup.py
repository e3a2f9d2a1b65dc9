"""The compiled pieces: the shared-memory index's probe (client/_index_probe.c) and its writer
(daemon/_index_writer.c). Optional: where they do not build (no C compiler), the install goes
on, the reader uses numpy and the daemon writes the index in Python."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvpool.client._index_probe", ["client/_index_probe.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("kvpool.daemon._index_writer", ["daemon/_index_writer.c"],
              extra_compile_args=["-O2"], optional=True),
])
