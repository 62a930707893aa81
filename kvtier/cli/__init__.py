"""The ``kvtier`` command: the entry point and one module per top-level command."""

from kvtier.cli.main import main

__all__ = ["main"]
