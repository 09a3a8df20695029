"""Registers the ``ds4 bench`` command. Imports only click and ds4_core; the benchmark loads CuPy when run."""

from __future__ import annotations

import click

from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


@click.command("bench")
@click.option("--synthetic", type=click.Choice(["deepseek4-flash"]), default="deepseek4-flash", show_default=True,
              help="Model shapes to synthesise in device memory (no file needed).")
@click.option("--recipe", type=click.Choice(["q2", "q4", "mxfp4"]), default="q2", show_default=True,
              help="Routed-expert formats: q2 = IQ2_XXS gate/up + Q2_K down, q4 = Q4_K, mxfp4 = MXFP4.")
@click.option("--layers", type=int, default=None,
              help="Decoder layers to build (default: all 43, fewer if memory is short).")
@click.option("--repeats", type=int, default=20, show_default=True, help="Timed repetitions of each measurement.")
@click.option("--prefill-tokens", type=int, multiple=True, default=(512, 2048), show_default=True,
              help="Token counts of the prefill-shaped matmul.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def bench(synthetic: str, recipe: str, layers: int | None, repeats: int, prefill_tokens: tuple[int, ...],
          as_json: bool) -> None:
    """Benchmark the CUDA backend on a synthetic DeepSeek V4 Flash against the HBM and tensor-core roofs."""
    import json

    from ds4_core.engine import probe_backends
    from ds4_core.errors import BackendError
    from ds4_core.plugins import get_plugin_manager

    cuda = next((c for c in probe_backends(get_plugin_manager().registry) if c.spec.name == "cuda"), None)
    if cuda is None or not cuda.usable:
        raise BackendError("ds4 bench measures the CUDA backend, which cannot run here: "
                           + (cuda.reason if cuda else "it is not installed (pip install 'ds4-core[cuda]')"))
    from .synthetic import print_report, run_all

    results = run_all(recipe=recipe, layers=layers, repeats=repeats, prefill_tokens=prefill_tokens)
    if as_json:
        click.echo(json.dumps(results, indent=1))
    else:
        print_report(results)


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(bench)
