"""kvpool: an out-of-process CPU KV-cache offload daemon for LLM inference engines.

The import packages live in the repository's top-level folders: ``kvpool.shared`` (``shared/``),
``kvpool.daemon`` (``daemon/``) and ``kvpool.client`` (``client/``). This file only makes
``kvpool`` a package; it imports nothing of ours, so an engine importing the client pays nothing
extra.

In a checkout, this folder is what ``import kvpool`` finds whenever the checkout's root is on
``sys.path`` (Python started in the root, pytest, ``python -m bench.x``), ahead of any installed
copy; its subpackages are not in it but beside it. So a checkout's ``kvpool`` also searches the
root: ``kvpool.client`` is then ``client/`` of the same checkout, installed or not, and never a
half of one copy and a half of another. An installed copy (no ``shared/protocol.py`` next to its
folder) is left as it is.
"""

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "shared", "protocol.py")) and \
        _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)  # noqa: F821  (a package's __path__)
del _os, _root
