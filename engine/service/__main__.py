"""`python -m engine.service [options]`: run the engine server (what the launcher starts)."""

from engine.service.cli import main

main()
