"""The ASGI application and ``ds4 serve``: routes, guards (auth, body limit, CORS), loading and startup."""

from __future__ import annotations

import hmac
import json
import socket
import sys
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ds4_core.errors import Ds4Error

from . import anthropic_api, openai_api, responses_api
from .common import ServerConfig, ServerState
from .errors import ApiError, error_body
from .generation import SlotPool

#: Routes anyone may call, even with --api-key.
PUBLIC_PATHS = frozenset({"/health"})


class Guard:
    """ASGI middleware: 64 MiB body limit (413 before any parsing) and API-key checks in constant time."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state
        key = state.config.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.key is not None and path not in PUBLIC_PATHS and not self._authorized(headers):
            return await _reply(send, path, 401, "invalid or missing API key; send 'Authorization: Bearer KEY' "
                                                 "or 'x-api-key: KEY'", {"WWW-Authenticate": "Bearer"})
        limit = self.state.config.max_body_bytes
        declared = headers.get("content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            return await _reply(send, path, 413 if declared.isdigit() else 400,
                                f"request body over the {limit // 2**20} MiB limit" if declared.isdigit()
                                else "malformed Content-Length header")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                return await _reply(send, path, 413, f"request body over the {limit // 2**20} MiB limit")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        assert self.key is not None
        bearer = headers.get("authorization", b"")
        token = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else b""
        given = headers.get("x-api-key", b"")
        # Both headers are compared, always, so timing says nothing about which one was tried.
        ok_bearer = hmac.compare_digest(token, self.key)
        ok_header = hmac.compare_digest(given, self.key)
        return ok_bearer or ok_header


async def _reply(send: Any, path: str, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(path, status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (load the engine separately with :func:`load_into`)."""
    app = FastAPI(title="ds4 server", version="0.1.0",
                  description="OpenAI Chat Completions / Completions / Responses and Anthropic Messages over ds4")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, exc.status, exc.message, exc.param), exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        return JSONResponse(error_body(request.url.path, 400, message, where or None), 400)

    @app.exception_handler(Ds4Error)
    async def ds4_error(request: Request, exc: Ds4Error) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, 400, str(exc)), 400)

    @app.get("/health")
    async def health() -> JSONResponse:
        pool = state.pool
        if pool is None:
            message = f"Model failed to load: {state.load_error}" if state.load_error else "Loading model"
            return JSONResponse({"error": {"code": 503, "message": message, "type": "unavailable_error"}}, 503)
        return JSONResponse({"status": "ok", "model": state.model_name, "slots_total": len(pool.slots),
                             "slots_busy": pool.busy, "queued": len(pool.waiters)})

    app.include_router(openai_api.router(state))
    app.include_router(responses_api.router(state))
    app.include_router(anthropic_api.router(state))
    app.add_middleware(Guard, state=state)
    if state.config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"])
    return app


def load_into(state: ServerState, on_failure: Any = None) -> None:
    """Load the model named by the config, then the slot pool and disk cache (runs on a background thread).

    On failure ``state.load_error`` is set (``/health`` reports it) and ``on_failure()`` is called.
    """
    from ds4_core.cli import resolve_model_path
    from ds4_core.descriptors import resolve
    from ds4_core.engine import Engine

    config = state.config
    try:
        path = config.model_path or resolve_model_path(None)
        engine = Engine.load(path, backend=config.backend, ctx=config.ctx)
        kv_store = None
        if config.kv_dir is not None:
            from .kvstore import model_identity

            spec = engine.registry.kv_stores.get("disk")
            if spec is None:
                raise Ds4Error("no 'disk' KV store is registered; reinstall ds4-server")
            kv_store = resolve(spec.factory)(config.kv_dir, config.kv_mb * 2**20, model_id=model_identity(path))
        state.loaded(engine, SlotPool(engine, config.slots, config.queue_limit, kv_store, config.kv_min_tokens,
                                      state.tracer))
        print(f"ds4 serve: model {state.model_name} ({engine.spec.name}) ready, ctx {engine.ctx}, "
              f"{config.slots} slot(s)", file=sys.stderr, flush=True)
    except Exception as exc:  # /health reports it and the process exits non-zero
        state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Ds4Error) else str(exc)
        print(f"error: {state.load_error}", file=sys.stderr, flush=True)
        if on_failure is not None:
            on_failure()


def serve(config: ServerConfig, host: str, port: int, log_level: str = "warning") -> None:
    """Bind ``host:port`` (0 picks a free port), print the address, load the model and serve until stopped."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this address can use the "
              "model", file=sys.stderr, flush=True)
    if "*" in config.cors:
        print("warning: --cors '*' lets any web page you visit call this server", file=sys.stderr, flush=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    bound = sock.getsockname()[1]
    state = ServerState(config)
    app = create_app(state)
    shown = f"[{host}]" if ":" in host else host
    print(f"ds4 serve: listening on http://{shown}:{bound}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))

    def stop() -> None:
        server.should_exit = True

    threading.Thread(target=load_into, args=(state, stop), name="ds4-load", daemon=True).start()
    server.run(sockets=[sock])
    if state.load_error:
        raise SystemExit(1)
