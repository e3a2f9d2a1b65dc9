"""kvpoold: the pool, the index, the copy engines, the sockets, the CLI.

Nothing in an engine process imports this package.
"""
