"""How much of a decode step's GPU time a kernel holds: the recorded step replayed with the kernel knocked out.

A kernel launched with programmatic dependent launch overlaps its neighbours, and branches of the recorded step run
beside the main chain, so a kernel's time alone (``decode_gemvs.py``, ``decode_glue.py``) or in a PDL-off timeline
(``profile_step.py``) overstates what removing it would save. Here each knockout is a copy of the installed CUDA
backend whose named kernels return as they start, once their predecessor is done (the launch stays, its outputs go
stale: the figures are times only), replayed by ``decode_replay.py`` in a process of its own beside the unchanged
backend; with two files of different layer counts the difference is a layer's share.

Usage: python benchmarks/critical_path.py FILE FILE KNOCKOUT [KNOCKOUT ...] [--replays 100] [--rounds 2]
KNOCKOUT: kernels knocked out together, comma-separated: ``attend_rows,attend_merge``, or a template's instance
``moe_gate_up_i8<IQ2_XXS>``. Needs a GPU with the CUDA backend; a knockout that leaves garbage which a later
kernel indexes memory by (expert ids, rows) can fault, so knock out what produces values, not indices.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import ds4_backend_cuda
import ds4_model_deepseek4

from ds4_core.gguf import GGUFFile

REPLAY = Path(__file__).with_name("decode_replay.py")
#: A type test for a template kernel's knockout, defined once per compiled module (quant.cu and quant_int8.cu share
#: one).
SAME = ("#ifndef DS4_KNOCKOUT_SAME\n#define DS4_KNOCKOUT_SAME\n"
        "template <class A, class B> struct KnockoutSame { static constexpr bool value = false; };\n"
        "template <class A> struct KnockoutSame<A, A> { static constexpr bool value = true; };\n#endif\n")


def knock_out(source: str, kernel: str) -> str | None:
    """``source`` with ``kernel`` (``name`` or ``name<Format>``) waiting for its predecessor and returning as it
    starts (its successors still wait for it, so the step's order holds), or None when the source does not define
    it."""
    name, _, fmt = kernel.partition("<")
    head = re.search(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?" + re.escape(name) + r"\(", source)
    if head is None:
        return None
    body = source.index("{", head.end()) + 1
    leave = " grid_wait(); return;"
    if fmt:
        leave = f" if (KnockoutSame<Q, {fmt.rstrip('>')}>::value) {{{leave} }}"
    return (SAME if fmt else "") + source[:body] + leave + source[body:]


def _copy_package(module: ModuleType, root: Path) -> Path:
    """A copy of the installed package ``module`` at ``root / its name`` (put ``root`` first on ``PYTHONPATH`` to
    run it); the copy's directory."""
    source = Path(module.__file__).parent
    package = root / source.name
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def copy_backend(root: Path) -> Path:
    """A copy of the installed ``ds4_backend_cuda`` at ``root / "ds4_backend_cuda"``."""
    return _copy_package(ds4_backend_cuda, root)


def copy_model(root: Path) -> Path:
    """A copy of the installed ``ds4_model_deepseek4`` at ``root / "ds4_model_deepseek4"``."""
    return _copy_package(ds4_model_deepseek4, root)


def patched_backend(kernels: list[str], root: Path) -> Path:
    """A copy of the installed ``ds4_backend_cuda`` under ``root`` with ``kernels`` knocked out; the directory to put
    first on ``PYTHONPATH``."""
    package = copy_backend(root)
    for kernel in kernels:
        for path in sorted((package / "kernels").glob("*.cu")):
            patched = knock_out(path.read_text(), kernel)
            if patched is not None:
                path.write_text(patched)
                break
        else:
            raise SystemExit(f"no kernel {kernel!r} in {package / 'kernels'}; name one defined with __global__")
    return root


def run_with(path: Path | None, command: list[str]) -> subprocess.CompletedProcess:
    """``command`` run with the backend found first at ``path`` on ``PYTHONPATH`` (None: the installed one)."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(path), env.get("PYTHONPATH"))))
    return subprocess.run(command, env=env, capture_output=True, text=True)


def replay_ms(files: list[Path], path: Path | None, replays: int, rounds: int,
              prompt_tokens: int = 2048) -> list[float]:
    """Median ms a step of each of ``files`` after ``prompt_tokens`` tokens, replayed with the backend found first at
    ``path`` (None: installed)."""
    done = run_with(path, [sys.executable, str(REPLAY), *map(str, files), "--replays", str(replays), "--rounds",
                           str(rounds), "--prompt-tokens", str(prompt_tokens)])
    medians = re.findall(r"median ([0-9.]+)\)", done.stdout)
    if done.returncode or len(medians) != len(files):
        raise SystemExit(f"the replay failed ({done.returncode}):\n{done.stdout}{done.stderr[-3000:]}")
    return [float(m) for m in medians]


def layers(path: Path) -> int:
    with GGUFFile.open(path, require_data=False) as gguf:
        return gguf.metadata.int(f"{gguf.architecture}.block_count")


def by_layers(files: list[Path]) -> tuple[Path, Path, int]:
    """(the file of more layers, the one of fewer, how many more): a layer's share is the difference of their steps
    over the last."""
    big, small = sorted(files, key=layers, reverse=True)
    span = layers(big) - layers(small)
    if span == 0:
        raise SystemExit(f"{big.name} and {small.name} have the same layer count; give two of different counts")
    return big, small, span


def layer_us(ms: list[float], span: int) -> float:
    """µs a layer from the steps' ms of the file of more layers and the one of fewer, ``span`` layers apart."""
    return (ms[0] - ms[1]) / span * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs=2, help="two GGUF files of one model with different layer counts")
    parser.add_argument("knockouts", nargs="+", help="comma-separated kernels knocked out together")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    big, small, span = by_layers(args.files)

    def row(label: str, ms: list[float], base: float | None) -> float:
        per_layer = layer_us(ms, span)
        change = "" if base is None else f"{per_layer - base:+8.2f}"
        print(f"{label:44s} {ms[0]:8.4f} {ms[1]:8.4f} {per_layer:9.2f} {change}", flush=True)
        return per_layer

    print(f"{'knocked out':44s} {big.name:>8s} {small.name:>8s} {'µs/layer':>9s} {'change':>8s}")
    first = replay_ms([big, small], None, args.replays, args.rounds)
    base = row("(nothing)", first, None)
    with tempfile.TemporaryDirectory() as tmp:
        for i, knockout in enumerate(args.knockouts):
            root = patched_backend(knockout.split(","), Path(tmp) / str(i))
            row(knockout, replay_ms([big, small], root, args.replays, args.rounds), base)
    row("(nothing), again", replay_ms([big, small], None, args.replays, args.rounds), base)


if __name__ == "__main__":
    main()
