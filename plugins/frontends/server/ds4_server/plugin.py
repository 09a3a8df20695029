"""Registration of ``ds4 serve`` and the disk KV store. Imports only the standard library, ds4_core and click."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from ds4_core.descriptors import KVStoreSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


def _opt(*names: str, env: str, **kwargs) -> Callable:
    """A click option readable from ``env`` too, with the variable named in --help."""
    kwargs["help"] = f"{kwargs.get('help', '')} (env: {env})"
    return click.option(*names, envvar=env, show_default=True, **kwargs)


@click.command()
@_opt("-m", "--model", env="DS4_MODEL", help="GGUF file or tiny:<family> (default: the embedded tiny model).")
@_opt("--host", env="DS4_HOST", default="127.0.0.1", help="Address to listen on; 0.0.0.0 exposes the server.")
@_opt("--port", env="DS4_PORT", type=click.IntRange(0, 65535), default=8000, help="TCP port; 0 picks a free one.")
@_opt("--ctx", env="DS4_CTX", type=click.IntRange(1),
      help="Context tokens per session (default: model max, at most 4096).")
@_opt("--backend", env="DS4_BACKEND", default="auto", help="numpy, cuda, metal … or auto.")
@_opt("--batched-session", "slots", env="DS4_BATCHED_SESSION", type=click.IntRange(1, 256), default=1,
      help="Independent session slots served concurrently.")
@_opt("--queue-limit", env="DS4_QUEUE_LIMIT", type=click.IntRange(0), default=64,
      help="Requests that may wait for a slot; more get 503 with Retry-After.")
@_opt("--api-key", env="DS4_API_KEY", help="Require this key (Bearer or x-api-key) on every route but /health.")
@_opt("--cors", env="DS4_CORS", multiple=True, help="Allow this browser origin (repeat for more); closed by default.")
@_opt("--alias", env="DS4_ALIAS", multiple=True,
      help="Model id to report and accept (repeat for more; the first is reported). Default: the file name.")
@_opt("--think/--nothink", env="DS4_THINK", default=True, help="Reason before answering unless a request says.")
@_opt("--sse-ping-interval", "ping_s", env="DS4_SSE_PING_INTERVAL", type=click.FloatRange(0.1), default=30.0,
      help="Seconds between keep-alive comments on a quiet stream.")
@_opt("--responses-store", env="DS4_RESPONSES_STORE", type=click.IntRange(0), default=256,
      help="Responses kept for previous_response_id (least recently used are dropped).")
@_opt("--kv-disk-dir", "kv_dir", env="DS4_KV_DISK_DIR", type=click.Path(file_okay=False, path_type=Path),
      help="Directory for the disk KV cache (created 0700); off when unset.")
@_opt("--kv-disk-space-mb", "kv_mb", env="DS4_KV_DISK_SPACE_MB", type=click.IntRange(1), default=8192,
      help="Disk KV cache budget in MiB; least recently used entries are evicted.")
@_opt("--kv-cache-min-tokens", "kv_min_tokens", env="DS4_KV_CACHE_MIN_TOKENS", type=click.IntRange(1), default=512,
      help="Save prompts of at least this many tokens to the disk cache.")
@_opt("--trace", env="DS4_TRACE", type=click.Path(dir_okay=False, path_type=Path),
      help="Append JSON lines of prompts, cache decisions and outputs to this file (sensitive).")
@_opt("--log-level", env="DS4_SERVER_LOG_LEVEL", default="warning",
      type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn log level.")
def serve(model: str | None, host: str, port: int, ctx: int | None, backend: str, slots: int, queue_limit: int,
          api_key: str | None, cors: tuple[str, ...], alias: tuple[str, ...], think: bool, ping_s: float,
          responses_store: int, kv_dir: Path | None, kv_mb: int, kv_min_tokens: int, trace: Path | None,
          log_level: str) -> None:
    """Serve the model over HTTP: OpenAI chat/completions/responses and Anthropic messages APIs.

    Prints 'ds4 serve: listening on http://HOST:PORT' on stderr once bound; /health answers 503 until
    the model is loaded, then 200.
    """
    from ds4_core.cli import resolve_model_path

    from .app import serve as run_server
    from .common import ServerConfig

    path = resolve_model_path(model) if model else None
    config = ServerConfig(model_path=path, ctx=ctx, backend=backend, slots=slots, queue_limit=queue_limit,
                          api_key=api_key or None, cors=cors, aliases=alias, think=think, ping_s=ping_s,
                          responses_store=responses_store, kv_dir=kv_dir, kv_mb=kv_mb, kv_min_tokens=kv_min_tokens,
                          trace=trace)
    run_server(config, host, port, log_level)


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(serve)


@hookimpl
def register_kv_stores(register: Callable[[KVStoreSpec], None]) -> None:
    register(KVStoreSpec(name="disk", factory="ds4_server.kvstore:create",
                         description="prefix snapshots on disk: checksummed, atomic writes, LRU within a budget"))
