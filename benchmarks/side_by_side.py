"""A decode step's GPU time with the installed CUDA backend and with other versions of it, replayed in turn.

Each VERSION is a directory of ``ds4_backend_cuda`` files laid out as in the package (``kernels/quant_int8.cu``,
``ops.py``, ...), and optionally of the DeepSeek V4 model plugin's under ``ds4_model_deepseek4/`` (a change to the
graph, such as the order of a step's branches): a copy of the installed backend (and model plugin) with those files
in place goes first on ``PYTHONPATH``, and the recorded step of both GGUF files (of one model, different layer
counts) is replayed by ``decode_replay.py`` in a process of its own. The installed backend runs first, then each
version, ALTERNATIONS times over, so that a drift of the machine shows in the installed backend's rows: how
docs/performance.md measures a change "beside main, alternately in one call". A version's first run compiles its
kernels; the replay's warm-up keeps that out of its times.

``--tests FILE ...`` first runs those test files (``pytest``, GPU and host tests alike) with each version; a version
whose tests fail is left out of the timings, with the tests' last lines printed. ``--alone`` also times each
version's weight kernels alone (``decode_gemvs.py``), a column a version, before the replays. ``--profile`` also
traces decode steps of the smaller file with each version (``profile_step.py``, the environment's
``DS4_CUDA_PDL`` as given: ``DS4_CUDA_PDL=0`` for each kernel's own time) and prints each kernel's µs a step, a column
a version: where a change's time went. ``--timeline N`` also lists, for each version, the last N kernels of one
traced step of the smaller file in order (``profile_step.py --timeline``: each one's start, µs and gap): when
kernels overlap, which one a change made wait.

``export REF DIR`` writes the backend's and the model plugin's files (its code, not its shipped data) at git revision
REF into DIR, run where the repository's history is (the device machine gets the working tree without it): ``python
benchmarks/side_by_side.py export main .ab/main`` in the repository (a directory git ignores, such as ``.ab/`` listed
in ``.git/info/exclude``, travels to the device when named in its carry), then there, with the working tree
installed, ``python benchmarks/side_by_side.py /tmp/f12.gguf /tmp/f4.gguf .ab/main``.

Usage: python benchmarks/side_by_side.py FILE FILE VERSION [VERSION ...] [--replays 100] [--rounds 2]
       [--alternations 2] [--prompt-tokens 2048] [--tests FILE ...] [--alone] [--profile] [--timeline [N]]
       python benchmarks/side_by_side.py export REF DIR
(the first needs a GPU with the CUDA backend; export needs git.)
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

#: The backend package's directory in the repository, and the model plugin's, whose files a version holds under
#: the package's name.
PACKAGE = "plugins/backends/cuda/ds4_backend_cuda"
MODEL_PACKAGE = "plugins/models/deepseek4/ds4_model_deepseek4"
MODEL = Path(MODEL_PACKAGE).name
ALONE = Path(__file__).with_name("decode_gemvs.py")
PROFILE = Path(__file__).with_name("profile_step.py")


#: What a version leaves out of the model plugin: its shipped data (the tiny models, megabytes that a replay never
#: reads and that would fill the device's carry).
MODEL_DATA = f"{MODEL_PACKAGE}/data/"


def export(ref: str, dest: Path) -> list[str]:
    """The files of :data:`PACKAGE` at git revision ``ref`` written under ``dest`` (paths relative to the package),
    and those of :data:`MODEL_PACKAGE` but its data (:data:`MODEL_DATA`) under ``dest / MODEL``; their paths."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", ref, PACKAGE, MODEL_PACKAGE],
                          capture_output=True)
    if done.returncode:
        raise SystemExit(f"git archive {ref} {PACKAGE} {MODEL_PACKAGE} failed: {done.stderr.decode().strip()}")
    names = []
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        for member in tar.getmembers():
            if member.isfile() and "__pycache__" not in member.name and not member.name.startswith(MODEL_DATA):
                name = member.name.removeprefix(PACKAGE + "/").replace(MODEL_PACKAGE, MODEL, 1)
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(tar.extractfile(member).read())
                names.append(name)
    return sorted(names)


def overlay(version: Path, package: Path) -> list[str]:
    """``version``'s files copied over the backend package directory ``package``, those under ``MODEL/`` over the
    model plugin's copy beside it (``package.parent / MODEL``); the paths of those that differ (new or changed). A
    file whose directory the package lacks is refused: under a wrong root it would change nothing."""
    names = sorted(str(p.relative_to(version)) for p in version.rglob("*") if p.is_file() and "__pycache__" not in
                   p.parts)
    if not names:
        raise SystemExit(f"{version}: no files; give a directory laid out as ds4_backend_cuda (kernels/*.cu, *.py)")

    def target(name: str) -> Path:
        return package.parent / name if Path(name).parts[0] == MODEL else package / name

    for name in names:
        if not target(name).parent.is_dir():
            where = MODEL if Path(name).parts[0] == MODEL else package.name
            raise SystemExit(f"{version / name}: {where} has no directory {target(name).parent.name}")
    changed = [n for n in names if not target(n).is_file() or target(n).read_bytes() != (version / n).read_bytes()]
    for name in changed:
        shutil.copyfile(version / name, target(name))
    return changed


def kernel_times(output: str) -> dict[str, float]:
    """``decode_gemvs.py``'s report lines (``NAME  12.34 us ...``) as {name: µs}."""
    return {m[1].strip(): float(m[2]) for m in re.finditer(r"^(\S.*?)\s+([0-9.]+) us\b", output, re.MULTILINE)}


def step_times(output: str) -> dict[str, float]:
    """``profile_step.py``'s table of kernels by name (the rows ``us/step  per step  mean us  KERNEL`` below its
    header) as {kernel: µs a step}, the kernel named up to its argument list."""
    times: dict[str, float] = {}
    lines = output.splitlines()
    header = next((i for i, line in enumerate(lines) if line.split()[:3] == ["us/step", "per", "step"]), len(lines))
    for line in lines[header + 1:]:
        row = re.fullmatch(r"\s*([0-9.]+)\s+[0-9.]+\s+[0-9.]+  (\S.*)", line)
        if not row:
            break
        times[row[2].split("(", 1)[0].strip()] = float(row[1])
    return times


def timeline_rows(output: str, last: int) -> list[str]:
    """``profile_step.py --timeline``'s header and the last ``last`` of the rows under it (``start us  us  gap us
    kernel``); none when the output has no timeline."""
    lines = output.splitlines()
    header = next((i for i, line in enumerate(lines) if line.split()[:3] == ["start", "us", "us"]), None)
    if header is None:
        return []
    rows = []
    for line in lines[header + 1:]:
        if not re.fullmatch(r"\s*-?[0-9.]+\s+[0-9.]+\s+-?[0-9.]+  \S.*", line):
            break
        rows.append(line)
    return [lines[header], *rows[-last:]] if last > 0 else []


def kernel_table(labels: list[str], times: list[dict[str, float]], title: str) -> str:
    """One row a kernel (in the order the versions first report them), one column of µs a version under ``title``;
    '-' where a version lacks it."""
    names = list(dict.fromkeys(name for t in times for name in t))
    width = max(len(title), *map(len, names))
    lines = [f"{title:{width}s} " + " ".join(f"{label[-12:]:>12s}" for label in labels)]
    for name in names:
        lines.append(f"{name:{width}s} " + " ".join(f"{t[name]:12.2f}" if name in t else f"{'-':>12s}"
                                                     for t in times))
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["export"]:
        parser = argparse.ArgumentParser(description="the CUDA backend's files at a git revision, into a directory")
        parser.add_argument("command")
        parser.add_argument("ref")
        parser.add_argument("dest", type=Path)
        args = parser.parse_args()
        print(f"{len(export(args.ref, args.dest))} files of {PACKAGE} and {MODEL_PACKAGE} at {args.ref} in "
              f"{args.dest}")
        return
    from critical_path import by_layers, copy_backend, copy_model, layer_us, replay_ms, run_with

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="A VERSION directory from git: side_by_side.py export REF DIR.")
    parser.add_argument("files", type=Path, nargs=2, help="two GGUF files of one model with different layer counts")
    parser.add_argument("versions", type=Path, nargs="+",
                        help="directories of ds4_backend_cuda files (and ds4_model_deepseek4/ files)")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alternations", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="context of the replayed steps")
    parser.add_argument("--tests", nargs="+", default=[], metavar="FILE",
                        help="test files each version must pass before it is timed")
    parser.add_argument("--alone", action="store_true", help="also time each version's weight kernels alone")
    parser.add_argument("--profile", action="store_true",
                        help="also trace the smaller file's steps with each version: each kernel's µs a step")
    parser.add_argument("--timeline", type=int, nargs="?", const=24, default=0, metavar="N",
                        help="also list the last N kernels (24 without N) of a traced step of the smaller file, in "
                             "order, with each version")
    args = parser.parse_args()
    big, small, span = by_layers(args.files)
    with tempfile.TemporaryDirectory() as tmp:
        roots: list[tuple[str, Path | None]] = [("installed", None)]
        for i, version in enumerate(args.versions):
            root = Path(tmp) / str(i)
            if (version / MODEL).is_dir():
                copy_model(root)
            changed = overlay(version, copy_backend(root))
            print(f"# {version}: {', '.join(changed) or 'the installed files'}", flush=True)
            if args.tests:
                done = run_with(root, [sys.executable, "-m", "pytest", "-q", *args.tests])
                if done.returncode:
                    print("\n".join((done.stdout + done.stderr).splitlines()[-15:]))
                    print(f"# {version}: left out, its tests failed")
                    continue
                print(f"# {version}: {done.stdout.strip().splitlines()[-1]}", flush=True)
            roots.append((str(version), root))
        def table(script: Path, options: list[str], parse: Callable[[str], dict[str, float]], title: str) -> None:
            times = []
            for label, root in roots:
                done = run_with(root, [sys.executable, str(script), *options])
                if done.returncode:
                    raise SystemExit(f"{script.name} failed with {label}:\n{done.stdout}{done.stderr[-3000:]}")
                times.append(parse(done.stdout))
            print(kernel_table([label for label, _ in roots], times, title), flush=True)

        if args.alone:
            table(ALONE, [], kernel_times, "kernel alone, µs")
        if args.profile:
            table(PROFILE, [str(small), "--prompt-tokens", str(args.prompt_tokens), "--steps", "3", "--top", "60"],
                  step_times, f"{small.name}: kernel, µs a step")
        if args.timeline:
            for label, root in roots:
                done = run_with(root, [sys.executable, str(PROFILE), str(small), "--prompt-tokens",
                                       str(args.prompt_tokens), "--steps", "3", "--top", "0", "--timeline"])
                rows = timeline_rows(done.stdout, args.timeline)
                if done.returncode or not rows:
                    raise SystemExit(f"{PROFILE.name} --timeline failed with {label}:\n{done.stdout}"
                                     f"{done.stderr[-3000:]}")
                print(f"# {label}: the last {len(rows) - 1} kernels of a step of {small.name}", *rows, sep="\n",
                      flush=True)
        print(f"{'version':40s} {big.name:>10s} {small.name:>10s} {'µs/layer':>9s}")
        for _ in range(args.alternations):
            for label, root in roots:
                ms = replay_ms([big, small], root, args.replays, args.rounds, args.prompt_tokens)
                print(f"{label[-40:]:40s} {ms[0]:10.4f} {ms[1]:10.4f} {layer_us(ms, span):9.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
