"""The ASGI application and ``ds4 serve``: routes, guards (auth, body limit, CORS), loading and startup."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import sys
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ds4_core.errors import Ds4Error

from . import anthropic_api, openai_api, responses_api
from .common import ServerConfig, ServerState
from .errors import ApiError, error_body
from .generation import SlotPool

#: Routes anyone may call, even with --api-key.
PUBLIC_PATHS = frozenset({"/health"})
_log = logging.getLogger("ds4_server")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class Guard:
    """ASGI middleware at the door of every HTTP request.

    It answers 413 for bodies over the limit before any parsing, 401 for a missing or wrong API key
    (compared in constant time), 400 for JSON with lone UTF-16 surrogates (they cannot be encoded back
    into a reply), and cancels the request's work as soon as the client disconnects, wherever it is:
    queued for a slot, prefilling, or generating a reply that is not streamed.
    """

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
        body = b"".join(chunks)
        if (where := lone_surrogate(body)) is not None:
            return await _reply(send, path, 400, f"{where}: the JSON text holds a lone UTF-16 surrogate escape "
                                                 "(\\uD800-\\uDFFF without its pair); send valid Unicode")
        replay = _Replay(body, receive)
        await _cancel_on_disconnect(self.app(scope, replay, send), replay)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        assert self.key is not None
        bearer = headers.get("authorization", b"")
        token = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else b""
        given = headers.get("x-api-key", b"")
        # Both headers are compared, always, so timing says nothing about which one was tried.
        ok_bearer = hmac.compare_digest(token, self.key)
        ok_header = hmac.compare_digest(given, self.key)
        return ok_bearer or ok_header


class _Replay:
    """The ASGI ``receive`` the app sees: the buffered body once, then ``http.disconnect`` once the client left."""

    def __init__(self, body: bytes, receive: Any):
        self.body: bytes | None = body
        self.receive = receive
        self.gone = asyncio.Event()

    async def __call__(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def watch(self) -> None:
        """Wait for the client to go away (servers also say so once the response is complete)."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()


async def _cancel_on_disconnect(app_call: Any, replay: _Replay) -> None:
    """Run ``app_call`` and cancel it when the client disconnects first.

    Starlette notices a disconnect only while it streams; a queued or non-streamed request would
    otherwise hold its slot until the whole reply had been generated for nobody.
    """
    work = asyncio.ensure_future(app_call)
    watcher = asyncio.ensure_future(replay.watch())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()


def lone_surrogate(body: bytes) -> str | None:
    """Where a JSON ``body`` holds a string with an unpaired surrogate escape (e.g. ``"\\udc80"``), else None.

    Such strings parse but cannot be encoded as UTF-8 again, so any reply echoing them would fail.
    Bodies without a surrogate escape (nearly all) are only scanned, not parsed.
    """
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None  # FastAPI reports the malformed body itself
    todo: list[tuple[str, Any]] = [("body", data)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            todo += [(f"{where}.{k}", v) for k, v in value.items()]
            todo += [(f"{where} key", k) for k in value]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return None


async def _reply(send: Any, path: str, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(path, status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _Cors(CORSMiddleware):
    """Starlette's CORS, answering an accepted preflight with 204 No Content (it answers 200 "OK")."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(status_code=204, headers=headers)


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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404), wrong methods (405) and bodies FastAPI cannot parse (400) in the native shape too.
        message = {404: f"no route {request.url.path!r}; see GET /openapi.json",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(request.url.path, exc.status_code, message), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        _log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(request.url.path, 500, f"internal error ({type(exc).__name__}: {exc}); "
                                                            "please report it with the request that caused it"), 500)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_native_errors(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

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
        app.add_middleware(_Cors, allow_origins=list(state.config.cors), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"])
    return app


#: Generation routes: their 200 is JSON, or an SSE stream with ``"stream": true``.
STREAMING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "description": "OpenAI routes: {error: {code, message, param, type}}; /v1/messages*: {type: 'error', error: "
                   "{type, message}}",
    "properties": {"error": {"type": "object", "required": ["message", "type"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}}}
_ERROR_STATUSES = {"400": "malformed request: bad JSON, wrong type or range, unsupported content, prompt over context",
                   "401": "missing or wrong API key", "404": "unknown model, route or previous response",
                   "413": "request body over the limit", "503": "model loading, or every slot busy and the queue full"}


def document_native_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Make FastAPI's OpenAPI document say what the server answers.

    FastAPI documents 422 for validation errors; this server answers 400 in each API's error shape
    (and 401/404/413/503), and generation routes may answer with an SSE stream.
    """
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, why in _ERROR_STATUSES.items():
                responses.setdefault(status, {"description": why, **error})
            if path in STREAMING_PATHS:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {}}
    schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    return schema


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


def exposed(host: str) -> bool:
    """True unless ``host`` is a loopback address: anything else may be reachable from the network."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return True


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning ``ds4 serve`` prints when it listens beyond loopback with no API key, else None."""
    if not exposed(host) or api_key:
        return None
    return (f"warning: listening on {host} without --api-key: anyone who can reach this address can use the "
            "model; pass --api-key or keep the default --host 127.0.0.1")


def serve(config: ServerConfig, host: str, port: int, log_level: str = "warning") -> None:
    """Bind ``host:port`` (0 picks a free port), print the address, load the model and serve until stopped."""
    import uvicorn

    if warning := exposure_warning(host, config.api_key):
        print(warning, file=sys.stderr, flush=True)
    if "*" in config.cors:
        print("warning: --cors '*' lets any web page you visit call this server", file=sys.stderr, flush=True)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Ds4Error(f"cannot listen on {host} port {port}: {exc.strerror or exc}; choose another --port "
                       "(0 picks a free one) or --host") from None
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
