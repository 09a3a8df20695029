"""``ds4 convert``: dispatch a Hugging Face checkpoint to the model plugin that converts it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .descriptors import resolve
from .errors import ConversionError
from .plugins import get_plugin_manager


def hf_architectures(src: Path) -> list[str]:
    """The ``architectures`` (or ``model_type``) named by ``src/config.json``."""
    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{src} has no config.json; point ds4 convert at a Hugging Face model directory") \
            from None
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{config_path} is not valid JSON: {exc}") from None
    names = list(config.get("architectures") or [])
    if config.get("model_type"):
        names.append(str(config["model_type"]))
    return names


def convert_command(src: Path, out: Path, outtype: str) -> None:
    """Find the converter for ``src`` and write ``out``, with a progress bar on stderr."""
    registry = get_plugin_manager().registry
    names = hf_architectures(src)
    spec = next((s for n in names if (s := registry.model_for_hf_architecture(n)) and s.converter), None)
    if spec is None:
        known = sorted(a for s in registry.models.values() if s.converter for a in s.hf_architectures)
        raise ConversionError(f"no installed model plugin converts {', '.join(names) or 'this checkpoint'}; "
                              f"convertible: {', '.join(known) or 'none'}")
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from .console import stderr_console

    with Progress(TextColumn("converting"), BarColumn(), DownloadColumn(), console=stderr_console(),
                  disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("convert", total=None)
        resolve(spec.converter)(src, out, outtype, lambda done, total: bar.update(task, completed=done, total=total))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {spec.name}, {outtype})", file=sys.stderr)
