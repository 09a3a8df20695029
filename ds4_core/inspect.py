"""``ds4 info``, ``ds4 plugins`` and ``ds4 backends``: what is in a file and what is installed."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from .console import stdout_console
from .descriptors import resolve
from .gguf import GGUFFile
from .memory import human_bytes
from .plugins import get_plugin_manager


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, list):
        head = ", ".join(_short(v, 20) for v in value[:6])
        return f"[{head}{', …' if len(value) > 6 else ''}] ({len(value)} items)"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: Contexts (tokens) at which ``ds4 info`` totals the decoding state, besides the model's maximum.
STATE_CONTEXTS = (4096, 32768, 131072)


def _tokens(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _split(parts: Mapping[str, int]) -> str:
    total = sum(parts.values())
    return f"{human_bytes(total)} ({total:,} B): " + ", ".join(f"{kind} {human_bytes(n)}" for kind, n in parts.items())


def state_summary(breakdown: Callable[[int], Mapping[str, int]], max_context: int) -> dict[str, str]:
    """The decoding-state rows of ``ds4 info``, for a model plugin's ``describe``.

    ``breakdown(ctx)`` maps each kind of state (KV rows, recurrent state, ...) to the bytes a context of ``ctx``
    tokens allocates. The rows give the growth per 1K (1024) tokens, the part that does not grow, and the totals at
    :data:`STATE_CONTEXTS` and ``max_context``, each with its exact byte count and split by kind.
    """
    fixed, at_1k = breakdown(0), breakdown(1024)
    growth = {kind: n - fixed.get(kind, 0) for kind, n in at_1k.items() if n != fixed.get(kind, 0)}
    rows = {"state per 1K tokens": _split(growth), "state, fixed": _split({k: n for k, n in fixed.items() if n})}
    for ctx in sorted({c for c in STATE_CONTEXTS if c < max_context} | {max_context}):
        rows[f"state at {_tokens(ctx)}" + (" (max)" if ctx == max_context else "")] = _split(breakdown(ctx))
    return rows


def file_summary(gguf: GGUFFile) -> dict[str, Any]:
    """Architecture, parameter count, tensor types, tokenizer and the model plugin's own summary."""
    md = gguf.metadata
    types: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    params = 0
    for t in gguf.tensors.values():
        n = 1
        for d in t.shape:
            n *= d
        params += n
        row = types[t.type_name]
        row[0] += 1
        row[1] += n
        row[2] += t.nbytes
    spec = get_plugin_manager().registry.model_for_architecture(gguf.architecture)
    model: dict[str, str] = {}
    if spec is not None and spec.describe:
        model = resolve(spec.describe)(gguf)
    tokens = md.get("tokenizer.ggml.tokens") or []
    template = md.get("tokenizer.chat_template")
    return {
        "file": str(gguf.path),
        "architecture": gguf.architecture,
        "name": md.get("general.name"),
        "plugin": spec.name if spec else None,
        "parameters": params,
        "tensor_bytes": sum(t.nbytes for t in gguf.tensors.values()),
        "tensors": len(gguf.tensors),
        "types": {k: {"tensors": v[0], "elements": v[1], "bytes": v[2]} for k, v in sorted(types.items())},
        "model": model,
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "vocab": len(tokens), "merges": len(md.get("tokenizer.ggml.merges") or []),
                      "bos": md.get("tokenizer.ggml.bos_token_id"), "eos": md.get("tokenizer.ggml.eos_token_id")},
        "chat_template": template,
    }


def info_command(path: Path, *, as_json: bool) -> None:
    """Print the summary of the GGUF at ``path`` (tensor data may be absent)."""
    with GGUFFile.open(path, require_data=False) as gguf:
        summary = file_summary(gguf)
        metadata = {k: gguf.metadata.get(k) for k in gguf.metadata.keys()}
    if as_json:
        summary["metadata"] = {k: v if not isinstance(v, list) or len(v) < 64 else f"<{len(v)} items>"
                               for k, v in metadata.items()}
        print(json.dumps(summary, indent=2, default=str))
        return
    console = stdout_console()
    head = Table(title=f"{path.name}", show_header=False)
    head.add_row("architecture", f"{summary['architecture']} (plugin: {summary['plugin'] or 'not installed'})")
    if summary["name"]:
        head.add_row("name", str(summary["name"]))
    head.add_row("parameters", _count(summary["parameters"]))
    head.add_row("tensor data", human_bytes(summary["tensor_bytes"]) + f" in {summary['tensors']} tensors")
    for key, value in summary["model"].items():
        head.add_row(key, str(value))
    tok = summary["tokenizer"]
    head.add_row("tokenizer", f"{tok['model']} / pre {tok['pre']}: {tok['vocab']} tokens, {tok['merges']} merges, "
                              f"bos {tok['bos']}, eos {tok['eos']}")
    template = summary["chat_template"]
    head.add_row("chat template", f"{len(template)} chars" if template else "none (the plugin renders chats)")
    console.print(head)
    types = Table(title="tensor types")
    for col in ("type", "tensors", "parameters", "bytes"):
        types.add_column(col, justify="right" if col != "type" else "left")
    for name, row in summary["types"].items():
        types.add_row(name, str(row["tensors"]), _count(row["elements"]), human_bytes(row["bytes"]))
    console.print(types)
    meta = Table(title="metadata")
    meta.add_column("key")
    meta.add_column("value", overflow="fold")
    for key, value in metadata.items():
        meta.add_row(key, _short(value))
    console.print(meta)


def plugins_report() -> list[dict[str, Any]]:
    """One entry per plugin: name, distribution, version, hooks, what it provides, and its load error."""
    pm = get_plugin_manager()
    reg = pm.registry
    provides: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for (hook, key), dist in reg.owners.items():
        provides[dist][hook.removeprefix("register_")].append(key)
    return [{"name": i.name, "distribution": i.distribution, "version": i.version, "hooks": list(i.hooks),
             "provides": {k: sorted(v) for k, v in provides.get(i.distribution, {}).items()},
             "error": i.error} for i in pm.infos]


def backends_command(*, as_json: bool, self_test: bool = False) -> None:
    """Print the probe result of every backend, and with ``self_test`` each usable backend's own checks."""
    from .engine import probe_backends
    from .errors import Ds4Error

    choices = probe_backends(get_plugin_manager().registry)
    rows = [{"name": c.spec.name, "device": c.spec.device, "priority": c.spec.priority, "available": c.usable,
             "reason": c.reason, "quant_types": list(c.spec.quant_types)} for c in choices]
    checks = [{"backend": c.spec.name, **row} for c in choices if self_test and c.usable and c.spec.self_test
              for row in resolve(c.spec.self_test)()]
    if as_json:
        print(json.dumps({"backends": rows, "self_test": checks} if self_test else rows, indent=2))
    else:
        table = Table(title="backends")
        for col in ("name", "device", "priority", "available", "reason"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], r["device"], str(r["priority"]), "yes" if r["available"] else "no", r["reason"])
        stdout_console().print(table)
        if self_test:
            tests = Table(title="self-test")
            for col in ("backend", "check", "status", "detail"):
                tests.add_column(col)
            for r in checks:
                tests.add_row(r["backend"], r["check"], r["status"], r["detail"])
            stdout_console().print(tests)
    failed = [f"{r['backend']}:{r['check']}" for r in checks if r["status"] == "failed"]
    if failed:
        raise Ds4Error(f"self-test failed for {', '.join(failed)}: those kernels stay disabled and the exact "
                       f"paths are used; please report this output with your hardware and driver versions")
