"""What the daemon and its clients must agree on: wire protocol, keys, layouts, config, errors.

Imports only msgspec and the standard library, never ``kvpool.daemon`` or ``kvpool.client``.
"""
