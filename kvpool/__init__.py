"""kvpool: an out-of-process CPU KV-cache offload daemon for LLM inference engines.

The import packages live in the repository's top-level folders: ``kvpool.shared`` (``shared/``),
``kvpool.daemon`` (``daemon/``) and ``kvpool.client`` (``client/``). This file only makes
``kvpool`` a package; it imports nothing, so an engine importing the client pays nothing extra.
"""
