"""What every API shares: server state, model names, thinking modes, prompts, sampling, replies, SSE."""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from ds4_core.chat import ContentDelta, ReasoningDelta, StreamEvent, Thinking, ToolCallEnd, ToolCallStart
from ds4_core.errors import Ds4Error
from ds4_core.sampling import SamplingParams

from .errors import ApiError
from .generation import Finished, GenRequest, SlotPool
from .trace import Tracer


@attrs.frozen
class ServerConfig:
    """Every ``ds4 serve`` option that shapes request handling."""

    model_path: Path | None = None
    ctx: int | None = None
    backend: str = "auto"
    slots: int = 1
    queue_limit: int = 64
    api_key: str | None = None
    cors: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    think: bool = True
    ping_s: float = 30.0
    responses_store: int = 256
    kv_dir: Path | None = None
    kv_mb: int = 8192
    kv_min_tokens: int = 512
    trace: Path | None = None
    max_body_bytes: int = 64 * 1024 * 1024


class ResponseStore:
    """Conversations behind stored Responses ids, for ``previous_response_id``; least recently used go first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        try:
            self._items.move_to_end(response_id)
            return self._items[response_id]
        except KeyError:
            raise ApiError(404, f"previous response {response_id!r} is not stored here (unknown, expired or "
                                f"evicted; the server keeps the last {self.capacity}); resend the full input",
                           param="previous_response_id") from None


class ServerState:
    """The loaded engine and slot pool (None while loading) plus per-server stores."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine: Any = None
        self.pool: SlotPool | None = None
        self.load_error: str | None = None
        self.model_name = config.aliases[0] if config.aliases else "ds4"
        self.names: set[str] = set(config.aliases)
        self.responses = ResponseStore(config.responses_store)
        self.tracer = Tracer(config.trace)

    def loaded(self, engine: Any, pool: SlotPool) -> None:
        self.engine, self.pool = engine, pool
        if not self.config.aliases:
            self.model_name = engine.path.stem
        self.names |= {self.model_name, engine.path.name, engine.spec.name, *engine.spec.aliases}

    def require_ready(self) -> SlotPool:
        if self.pool is None:
            message = f"Model failed to load: {self.load_error}" if self.load_error else "Loading model"
            raise ApiError(503, message, headers={"Retry-After": "1"})
        return self.pool

    def check_model(self, name: str | None) -> str:
        """The served model's id; 404 for a name this server does not answer to."""
        if name and name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here; use {self.model_name!r} "
                                f"(also accepted: {', '.join(sorted(self.names - {self.model_name}))})",
                           param="model")
        return self.model_name

    def thinking(self, *, effort: str | None = None, enabled: bool | None = None) -> Thinking:
        """The chat format's thinking mode from a request's reasoning switches (server default otherwise)."""
        if enabled is False or effort == "none":
            return "none"
        if effort == "max":
            return "max"
        if enabled or effort is not None:
            return "high"
        return "high" if self.config.think else "none"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def sampling(temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None,
             seed: int | None) -> SamplingParams:
    """SamplingParams with ds4 defaults for the fields a request leaves out; 400 for unusable values."""
    fields = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "seed": None if seed == -1 else seed}
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except Ds4Error as exc:
        raise ApiError(400, str(exc)) from None


async def chat_prompt(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      thinking: Thinking) -> list[int]:
    """Render ``messages`` off the event loop; 400 for what the chat format refuses or a prompt over context."""
    engine = state.engine
    if engine.chat_format is None:
        raise ApiError(400, f"model {state.model_name!r} has no chat format; use /v1/completions")
    try:
        prompt = await asyncio.to_thread(engine.render, messages, tools=tools or None, thinking=thinking)
    except Ds4Error as exc:
        raise ApiError(400, f"cannot render the conversation: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, f"malformed message or tool: {type(exc).__name__}: {exc}") from None
    state.tracer.write("prompt", text=engine.tokenizer.decode(prompt), tokens=len(prompt))
    return prompt


def gen_request(state: ServerState, prompt: list[int], max_tokens: int | None, params: SamplingParams,
                stop: Sequence[str] | str | None, parser: Any) -> GenRequest:
    """A GenRequest whose budget fits the context; 400 when the prompt alone does not fit."""
    ctx = state.engine.ctx
    if len(prompt) >= ctx:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens but the context is {ctx}; shorten the input "
                            f"or restart the server with a larger --ctx", param="messages")
    room = ctx - len(prompt)
    budget = room if max_tokens is None else min(max_tokens, room)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return GenRequest(prompt, budget, params, stops, parser)


@attrs.define
class Reply:
    """A whole reply accumulated from stream events (non-streaming responses)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, str]] = attrs.Factory(list)
    finished: Finished | None = None

    def add(self, event: StreamEvent | Finished) -> None:
        if isinstance(event, ContentDelta):
            self.content += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            self.tool_calls.append({"id": event.id, "name": event.name, "arguments": ""})
        elif isinstance(event, ToolCallEnd):
            self.tool_calls[-1]["arguments"] = event.arguments
        elif isinstance(event, Finished):
            self.finished = event


async def collect(events: AsyncIterator[Any]) -> Reply:
    reply = Reply()
    try:
        async for event in events:
            reply.add(event)
    finally:
        await events.aclose()
    return reply


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


def text_of(content: Any, *, what: str = "content") -> str:
    """Plain text of a message content: a string, or a list of text parts; 400 for images and other media."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{what}: content must be a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{what}: a {kind} part needs a string 'text'")
            parts.append(part["text"])
        elif kind in ("image_url", "input_image", "image", "input_audio", "file", "input_file", "document"):
            raise ApiError(400, f"{what}: {kind} parts are not supported by this server (text only)")
        else:
            raise ApiError(400, f"{what}: unknown content part type {kind!r}")
    return "".join(parts)


def arguments_text(arguments: Any) -> str:
    """Tool-call arguments as a JSON text (clients send a string or an already-parsed object)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parse_arguments(text: str) -> Any:
    """Parsed tool-call arguments; a text that is not JSON is kept as a string under ``_raw``."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_value": value}
