"""Registers the ``ds4 bench`` command. Imports only click and ds4_core; the benchmark loads CuPy when run."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


#: ``--synthetic`` model -> the recipes it has. Static, so the CLI imports nothing heavy.
MODELS: dict[str, tuple[str, ...]] = {"deepseek4-flash": ("q2", "q4", "mxfp4"), "glm53-flash": ("q2", "q4"),
                                      "qwen38-flash": ("q2", "q4")}
#: ``--synthetic`` model -> the module whose ``MODEL`` (a :class:`.synthetic_plan.SyntheticModel`) describes it.
MODEL_MODULES: dict[str, str] = {"deepseek4-flash": "synthetic_deepseek4", "glm53-flash": "synthetic_glm53",
                                 "qwen38-flash": "synthetic_qwen38"}


@click.command("bench", epilog="The CUDA backend decodes with int8 activations and prefills on fp16/bf16 tensor "
                                "cores; DS4_CUDA_INT8=0 and DS4_CUDA_PREFILL=32 measure its float32 paths. Each "
                                "report names the arithmetic it measured.")
@click.option("--synthetic", type=click.Choice(list(MODELS)), default="deepseek4-flash", show_default=True,
              help="Model shapes to synthesise in device memory (no file needed).")
@click.option("--recipe", type=click.Choice(["q2", "q4", "mxfp4"]), default="q2", show_default=True,
              help="Routed-expert formats: q2 = IQ2_XXS gate/up + Q2_K down, q4 = Q4_K (Qwen: MXFP4 down), "
                   "mxfp4 = MXFP4 (DeepSeek only).")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Decoder layers to build for decode (default: all of the model's, fewer if memory is short).")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Timed repetitions of each measurement, of which the median is reported (default: 20; with "
                   "--model, 5 prefills).")
@click.option("--context", "contexts", type=click.IntRange(min=1), multiple=True, default=(2048, 32768),
              show_default=True, help="Cached tokens whose state reads a decode step adds (context 0, weights only, "
                                      "is always measured).")
@click.option("--prefill-tokens", type=click.IntRange(min=1), multiple=True, default=(2048, 16384), show_default=True,
              help="Token counts of the prefill matmuls.")
@click.option("-m", "--model", "model_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Instead: time a GGUF end to end through Engine (prefill, then decode with and "
                                 "without graph replay).")
@click.option("--backend", default="cuda", show_default=True, help="Backend for --model.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt length for --model.")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Decoded tokens timed for --model.")
@click.option("--write-gguf", "gguf_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Instead: write the synthetic DeepSeek V4 Flash (--recipe, --layers) as a ds4-schema GGUF with "
                   "random weights, to time with -m (no GPU needed to write).")
@click.option("--engine/--no-engine", default=True, show_default=True,
              help="deepseek4-flash: also time the whole model through the DeepSeek V4 plugin's own graph (chunked "
                   "prefill and the recorded decode step, glue included), its weights built in device memory.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def bench(synthetic: str, recipe: str, layers: int | None, repeats: int | None, contexts: tuple[int, ...],
          prefill_tokens: tuple[int, ...], model_path: Path | None, backend: str, prompt_tokens: int,
          decode_tokens: int, gguf_path: Path | None, engine: bool, as_json: bool) -> None:
    """Benchmark the CUDA backend on a synthetic DeepSeek V4 Flash, GLM 5.3 Flash or Qwen3.8 Flash Next against
    the HBM and tensor-core roofs, or (``-m``) a model file end to end."""
    import importlib
    import json

    if gguf_path is not None:
        _write_gguf(gguf_path, synthetic, recipe, layers)
        return
    if model_path is not None:
        from .engine_decode import measure, print_measurement

        # without --repeats each measurement keeps its own function's default (the help says which)
        result = measure(model_path, backend, prompt_tokens, decode_tokens,
                         **({} if repeats is None else {"prefill_runs": repeats}))
        if as_json:
            click.echo(json.dumps(result, indent=1))
        else:
            print_measurement(result)
        return

    from ds4_core.engine import probe_backends
    from ds4_core.errors import BackendError
    from ds4_core.plugins import get_plugin_manager

    if recipe not in MODELS[synthetic]:
        raise click.BadParameter(f"{synthetic} has the recipes {', '.join(MODELS[synthetic])}, not {recipe}",
                                 param_hint="'--recipe'")
    explicit = click.get_current_context().get_parameter_source("engine") is not ParameterSource.DEFAULT
    if engine and explicit and synthetic != "deepseek4-flash":
        raise click.BadParameter(f"the whole-model timing is built for deepseek4-flash only, not {synthetic}; "
                                 "leave --engine out", param_hint="'--engine'")
    cuda = next((c for c in probe_backends(get_plugin_manager().registry) if c.spec.name == "cuda"), None)
    if cuda is None or not cuda.usable:
        raise BackendError("ds4 bench measures the CUDA backend, which cannot run here: "
                           + (cuda.reason if cuda else "it is not installed (pip install 'ds4-core[cuda]')"))
    from .synthetic_run import print_report, run_model

    model = importlib.import_module(f".{MODEL_MODULES[synthetic]}", __package__).MODEL
    results = run_model(model, recipe, layers, contexts=contexts, prefill_tokens=prefill_tokens,
                        **({} if repeats is None else {"repeats": repeats}))
    if engine and synthetic == "deepseek4-flash":
        from .flash_engine import engine_results

        results["engine"] = engine_results(recipe, results["decode"]["layers"], contexts, prefill_tokens,
                                           repeats or 20, results["hbm_copy_bytes_per_s"],
                                           results["matmul_flop_per_s"])
        results["seconds"] += results["engine"]["seconds"]
    if as_json:
        click.echo(json.dumps(results, indent=1))
    else:
        print_report(results)


def _write_gguf(path: Path, synthetic: str, recipe: str, layers: int | None) -> None:
    """``--write-gguf``: write the file, then say how big it is and how to time it."""
    if synthetic != "deepseek4-flash":
        raise click.BadParameter(f"only deepseek4-flash can be written as a GGUF, not {synthetic}",
                                 param_hint="'--synthetic'")
    if layers is None:
        raise click.BadParameter("say how many decoder layers to write (4 layers of Q2 are ~9.5 GB)",
                                 param_hint="'--layers'")
    from .flash_gguf import write_flash_gguf

    write_flash_gguf(path, layers, recipe)
    plural = "s" if layers != 1 else ""
    click.echo(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {layers} layer{plural}, recipe {recipe}); "
               "time it with:")
    click.echo(f"  ds4 bench -m {path} --prompt-tokens 2048 --decode-tokens 32")


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(bench)
