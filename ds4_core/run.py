"""``ds4 run``: one-shot generation or an interactive chat, streamed to stdout."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from .chat import ContentDelta, ReasoningDelta, ToolCallEnd, ToolCallStart
from .engine import Engine, Session
from .sampling import SamplingParams


def run_command(path: Path, *, prompt: str | None, max_tokens: int, temp: float, top_k: int, top_p: float,
                min_p: float, seed: int | None, ctx: int | None, backend: str, think: bool, system: str | None,
                raw: bool, default_model: bool, options: dict[str, Any]) -> None:
    """Load ``path`` and generate; without ``prompt``, chat turn by turn on stdin."""
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)  # checked first
    engine = Engine.load(path, backend=backend, ctx=ctx, progress=sys.stderr.isatty(), **options)
    if default_model:
        click.echo(f"[embedded tiny {engine.spec.name} model {path.name}, a demo trained on Python's standard "
                   f"library; pass -m FILE.gguf for a real model]", err=True)
    if raw or engine.chat_format is None:
        if prompt is None:
            prompt = click.prompt("prompt", err=True)
        _stream_raw(engine, prompt, max_tokens, params)
        return
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    interactive = prompt is None
    if interactive:
        click.echo("Chat with the model; an empty line or Ctrl+D quits, Ctrl+C stops a reply.", err=True)
    while True:
        if interactive:
            try:
                prompt = input("> ")
            except EOFError:
                click.echo("", err=True)
                return
            if not prompt.strip():
                return
        messages.append({"role": "user", "content": prompt})
        reply = _stream_chat(engine, messages, max_tokens, params, think)
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            return


def _stream_raw(engine: Engine, prompt: str, max_tokens: int, params: SamplingParams) -> None:
    session = engine.new_session()
    ids = engine.tokenizer.encode(prompt, special=False)
    if engine.tokenizer.bos_id is not None:
        ids = [engine.tokenizer.bos_id, *ids]
    click.echo(prompt, nl=False)
    _timed(session, ids, lambda text: click.echo(text, nl=False), max_tokens, params, ())


def _stream_chat(engine: Engine, messages: list[dict[str, Any]], max_tokens: int, params: SamplingParams,
                 think: bool) -> str:
    thinking = "high" if think else "none"
    assert engine.chat_format is not None
    parser = engine.chat_format.parser(thinking=thinking, tools=False)
    answer: list[str] = []

    def show(text: str) -> None:
        for event in parser.feed(text):
            _show_event(event, answer)

    _timed(engine.new_session(), engine.render(messages, thinking=thinking), show, max_tokens, params,
           tuple(engine.chat_format.stop_strings))
    for event in parser.finish():
        _show_event(event, answer)
    click.echo("")
    return "".join(answer)


def _show_event(event: Any, answer: list[str]) -> None:
    if isinstance(event, ContentDelta):
        answer.append(event.text)
        click.echo(event.text, nl=False)
    elif isinstance(event, ReasoningDelta):
        click.secho(event.text, nl=False, dim=True)
    elif isinstance(event, ToolCallStart):
        click.secho(f"\n[tool call {event.name}] ", nl=False, fg="cyan")
    elif isinstance(event, ToolCallEnd):
        click.secho(event.arguments, nl=False, fg="cyan")


def _timed(session: Session, prompt: list[int], emit: Any, max_tokens: int, params: SamplingParams,
           stops: tuple[str, ...]) -> None:
    """Stream a generation, then report prompt and generation speed on stderr; Ctrl+C ends the reply only."""
    t0 = time.perf_counter()
    session.feed(prompt, logits="last")
    t1 = time.perf_counter()
    n = 0
    try:
        for piece in session.generate(max_tokens=max_tokens, sampling=params, stop_strings=stops):
            n += 1
            emit(piece.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        click.echo("\n[stopped]", err=True)
    t2 = time.perf_counter()
    click.echo(f"\n[prompt: {len(prompt)} tokens, {len(prompt) / max(t1 - t0, 1e-9):.1f} t/s | "
               f"generation: {n} tokens, {n / max(t2 - t1, 1e-9):.1f} t/s]", err=True)
