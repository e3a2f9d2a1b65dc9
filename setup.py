"""The one compiled piece: the shared-memory index's probe (client/_index_probe.c). Optional:
where it does not build (no C compiler), the install goes on and the reader uses numpy."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool.client._index_probe", ["client/_index_probe.c"],
                             extra_compile_args=["-O2"], optional=True)])
