"""The ``ds4`` command line: a click group whose subcommands come from the core and from plugins.

Plugins are loaded only when a subcommand is listed or resolved, and no command
module imports a GPU library at import time, so ``ds4 --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from .errors import Ds4Error

#: Model family used when ``ds4 run`` / ``ds4 serve`` get no ``-m``.
DEFAULT_TINY = "deepseek4"


class Ds4Group(click.Group):
    """A click group that adds plugin commands on first use and turns Ds4Error into one clear line."""

    _plugins_added = False

    def _add_plugin_commands(self) -> None:
        if not self._plugins_added:
            self._plugins_added = True
            from .plugins import get_plugin_manager

            get_plugin_manager().add_commands(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._add_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        self._add_plugin_commands()
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Ds4Error as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=Ds4Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ds4-core", prog_name="ds4")
@click.option("--debug", is_flag=True, envvar="DS4_DEBUG", help="Show tracebacks for errors (env: DS4_DEBUG).")
@click.option("--log-json", is_flag=True, envvar="DS4_LOG_JSON", help="Write logs as JSON lines (env: DS4_LOG_JSON).")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, log_json: bool, verbose: bool) -> None:
    """ds4: run DeepSeek V4, GLM 5.x and Qwen3.8 GGUF models on your own hardware.

    Start with `ds4 run` (the embedded tiny model) or `ds4 run -m MODEL.gguf -p "..."`.
    Subcommands marked by plugins appear here once their plugin is installed.
    """
    import logging

    from .log import configure

    configure(json=log_json, level=logging.DEBUG if verbose else logging.WARNING)
    ctx.obj = {"debug": debug}


def resolve_model_path(model: str | None) -> Path:
    """A GGUF path from ``-m``: a file, ``tiny:<family>``, or nothing (the embedded default)."""
    from .plugins import get_plugin_manager

    if model is not None and not model.startswith("tiny:"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise Ds4Error(f"model file {str(path)!r} does not exist; pass a .gguf path or tiny:<family>")
        return path
    family = model.split(":", 1)[1] if model else DEFAULT_TINY
    registry = get_plugin_manager().registry
    spec = registry.models.get(family) or next((s for s in registry.models.values() if family in s.aliases), None)
    if spec is None or spec.tiny is None:
        have = sorted(s.name for s in registry.models.values() if s.tiny)
        raise Ds4Error(f"no embedded tiny model {family!r}; available: {', '.join(have) or 'none'} "
                       f"(install a model plugin, e.g. pip install 'ds4-core[deepseek4]')")
    from .descriptors import resolve

    return Path(resolve(spec.tiny)(cache_dir()))


def cache_dir() -> Path:
    """The user cache directory of ds4 (``DS4_CACHE`` overrides)."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("DS4_CACHE") or user_cache_dir("ds4"))


@cli.command()
@click.option("-m", "--model", help="GGUF file, or tiny:<family> (default: the embedded tiny DeepSeek V4).")
@click.option("-p", "--prompt", help="Prompt text; without it (and without --prompt-file) ds4 chats interactively.")
@click.option("--prompt-file", type=click.File("r"), help="Read the prompt from a file ('-' for stdin).")
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate per reply.")
@click.option("--temp", default=1.0, show_default=True, help="Sampling temperature; 0 = greedy.")
@click.option("--top-k", default=0, show_default=True, help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass.")
@click.option("--min-p", default=0.05, show_default=True, help="Drop tokens below min-p × the top probability.")
@click.option("--seed", type=int, help="Random seed for reproducible sampling.")
@click.option("--ctx", type=int, help="Context length in tokens (default: min(model max, 4096)).")
@click.option("--backend", default="auto", show_default=True, help="numpy, cuda, metal … or auto.")
@click.option("--think/--nothink", default=False, show_default=True, help="Let the model reason before answering.")
@click.option("--system", help="System prompt.")
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, without the chat template.")
@click.option("--qat-rounding", is_flag=True,
              help="DeepSeek V4: simulate ds4's FP8 KV and FP4 indexer rounding (same as -O qat_rounding=true).")
@click.option("-O", "--model-option", "model_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the model plugin (repeatable); unknown keys are refused by the plugin.")
def run(model: str | None, prompt: str | None, prompt_file: Any, max_tokens: int, temp: float, top_k: int,
        top_p: float, min_p: float, seed: int | None, ctx: int | None, backend: str, think: bool,
        system: str | None, raw: bool, qat_rounding: bool, model_options: tuple[str, ...]) -> None:
    """Generate text from a model, streaming it to stdout."""
    from .run import run_command

    if prompt_file is not None:
        prompt = prompt_file.read()
    options = parse_model_options(model_options)
    if qat_rounding:
        options["qat_rounding"] = True
    run_command(resolve_model_path(model), prompt=prompt, max_tokens=max_tokens, temp=temp, top_k=top_k,
                top_p=top_p, min_p=min_p, seed=seed, ctx=ctx, backend=backend, think=think, system=system,
                raw=raw, default_model=model is None or model.startswith("tiny:"), options=options)


def parse_model_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to a dict; values read as bool, int, float or else string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise Ds4Error(f"model option {pair!r} is not KEY=VALUE")
        value: Any = {"true": True, "false": False}.get(text.lower(), text)
        if isinstance(value, str):
            for cast in (int, float):
                try:
                    value = cast(text)
                    break
                except ValueError:
                    pass
        options[key.replace("-", "_")] = value
    return options


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def info(file: Path, as_json: bool) -> None:
    """Summarise a GGUF file: architecture, parameters, tensor types, tokenizer, chat template."""
    from .inspect import info_command

    info_command(file, as_json=as_json)


@cli.command()
def plugins() -> None:
    """List installed plugins as JSON: name, version, hooks, what each provides, load errors."""
    from .inspect import plugins_report

    click.echo(json.dumps(plugins_report(), indent=2))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--self-test", is_flag=True,
              help="Also run each available backend's own checks (e.g. custom kernels against exact paths).")
def backends(as_json: bool, self_test: bool) -> None:
    """Probe every installed backend and say which can run here, and why not."""
    from .inspect import backends_command

    backends_command(as_json=as_json, self_test=self_test)


@cli.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="q8_0", show_default=True,
              help="Type of the large matrices; small tensors stay F32/F16 as the schema wants.")
def convert(src: Path, out: Path, outtype: str) -> None:
    """Convert a Hugging Face checkpoint directory SRC to a ds4 GGUF file OUT."""
    from .convert import convert_command

    convert_command(src, out, outtype)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="ds4")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
