"""``ds4 metal-self-test``: the load-time kernel self-test, on demand, as a table or JSON."""

from __future__ import annotations

import json
import sys

import click


def run_self_test_command(*, as_json: bool) -> None:
    """Print one row per custom kernel; exit with status 1 when any kernel failed."""
    try:
        from .kernels import verify_and_enable
    except ImportError as exc:
        raise click.ClickException(f"MLX is not installed ({exc}); pip install mlx") from exc
    results = verify_and_enable()
    if as_json:
        click.echo(json.dumps([{"kernel": r.name, "status": r.status, "detail": r.detail} for r in results]))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="custom Metal kernels")
        for col in ("kernel", "status", "detail"):
            table.add_column(col)
        for r in results:
            table.add_row(r.name, r.status, r.detail)
        Console().print(table)
    if any(r.status == "failed" for r in results):
        click.echo("some kernels failed and stay disabled; please report the output above "
                   "(with your Mac model and macOS/MLX versions) to the ds4-core issue tracker", err=True)
        sys.exit(1)
