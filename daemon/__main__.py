"""``python -m kvpool.daemon`` runs kvpoold."""

from kvpool.daemon.cli import serve_main

serve_main()
