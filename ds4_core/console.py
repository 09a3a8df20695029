"""Shared rich consoles: tables and progress go to stderr unless they are the command's output."""

from __future__ import annotations

from functools import cache

from rich.console import Console


@cache
def stderr_console() -> Console:
    return Console(stderr=True)


@cache
def stdout_console() -> Console:
    return Console()
