"""OpenAI Chat Completions, Completions and Models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart

from .common import (
    Reply,
    ServerState,
    arguments_text,
    chat_prompt,
    collect,
    gen_request,
    new_id,
    sampling,
    sse,
    text_of,
)
from .errors import ApiError, error_body
from .generation import Finished, Ping

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "stop"}
#: Integer fields are int64, as in the APIs this server mimics; larger values are a 400, not a wrap-around.
MAX_INT = 2**63 - 1
#: Alternatives a request may list with ``top_logprobs`` (OpenAI's own limit).
MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    """Unknown fields are ignored; known ones are strict: no strings or booleans for numbers, no NaN or inf."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class SamplingFields(_Lenient):
    model: str | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, le=MAX_INT, description="-1 or absent: a random seed")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    stop: str | list[str] | None = Field(None, max_length=16)
    n: int = Field(1, ge=1, le=1, description="only one choice per request is generated")
    stream_options: dict[str, Any] | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool | None = Field(None, description="accepted; log probabilities are not returned")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking: dict[str, Any] | bool | None = None
    think: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5, description="accepted; log probabilities are not returned")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages in the chat-format contract (string content, reasoning in ``reasoning_content``)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": text_of(m.content, what=f"messages[{i}].content")}
        reasoning = m.reasoning_content or m.reasoning or m.thinking
        if reasoning and m.role == "assistant":
            msg["reasoning_content"] = reasoning
        if m.tool_calls and m.role == "assistant":
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": arguments_text(c.function.arguments)}} for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


def select_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    """The tools to render under ``tool_choice``: none drops them, a named function keeps only that one."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function") or {}
        name = function.get("name") if isinstance(function, dict) else None
        name = name or choice.get("name")
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": NAME}}', param="tool_choice")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return chosen
    if choice not in (None, "auto", "required", "any"):
        raise ApiError(400, f"tool_choice {choice!r} is not one of none, auto, required or a function",
                       param="tool_choice")
    return tools


def usage_json(finished: Finished) -> dict[str, Any]:
    u = finished.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def finish_reason(reply_has_tools: bool, finished: Finished) -> str:
    return "tool_calls" if reply_has_tools and finished.reason != "length" else _FINISH[finished.reason]


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        state.require_ready()
        engine = state.engine
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(engine.path.stat().st_mtime),
            "owned_by": "ds4", "aliases": sorted(state.names - {state.model_name}),
            "meta": {"family": engine.spec.name, "n_ctx": engine.ctx, "n_vocab": engine.tokenizer.vocab_size,
                     "slots": len(state.pool.slots)}}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        pool = state.require_ready()
        model = state.check_model(body.model)
        kwargs = body.chat_template_kwargs or {}
        enabled = body.think if body.think is not None else kwargs.get("enable_thinking")
        if isinstance(body.thinking, bool):
            enabled = body.thinking
        elif isinstance(body.thinking, dict):
            enabled = body.thinking.get("type") != "disabled"
        thinking = state.thinking(effort=body.reasoning_effort or kwargs.get("reasoning_effort"), enabled=enabled)
        tools = select_tools([t.model_dump(exclude_none=True) for t in body.tools or ()], body.tool_choice)
        prompt = await chat_prompt(state, chat_messages(body.messages), tools, thinking)
        parser = state.engine.chat_format.parser(thinking=thinking, tools=bool(tools))
        req = gen_request(state, prompt, body.max_completion_tokens or body.max_tokens,
                          sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed), body.stop, parser)
        cid, created = new_id("chatcmpl"), int(time.time())
        events = await pool.start(req, ping_s=state.config.ping_s)
        if not body.stream:
            reply = await collect(events)
            return chat_response(reply, cid, created, model)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(chat_stream(events, cid, created, model, include_usage, request.url.path),
                                 media_type="text/event-stream")

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        pool = state.require_ready()
        model = state.check_model(body.model)
        prompt = completion_prompt(state, body.prompt)
        req = gen_request(state, prompt, body.max_tokens if body.max_tokens is not None else 16,
                          sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed), body.stop, None)
        cid, created = new_id("cmpl"), int(time.time())
        events = await pool.start(req, ping_s=state.config.ping_s)
        if not body.stream:
            reply = await collect(events)
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": reply.content, "logprobs": None,
                                 "finish_reason": _FINISH[reply.finished.reason]}],
                    "usage": usage_json(reply.finished), "timings": reply.finished.usage.timings()}
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(completion_stream(events, cid, created, model, include_usage, request.url.path),
                                 media_type="text/event-stream")

    return api


def completion_prompt(state: ServerState, prompt: str | list[str] | list[int]) -> list[int]:
    tok = state.engine.tokenizer
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        if any(not 0 <= p < tok.vocab_size for p in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{tok.vocab_size - 1}", param="prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    ids = tok.encode(prompt, special=True)
    return [tok.bos_id, *ids] if tok.bos_id is not None and ids[:1] != [tok.bos_id] else ids


def chat_response(reply: Reply, cid: str, created: int, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in reply.tool_calls]
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(bool(reply.tool_calls), reply.finished)}],
            "usage": usage_json(reply.finished), "timings": reply.finished.usage.timings()}


async def chat_stream(events: AsyncIterator[Any], cid: str, created: int, model: str, include_usage: bool,
                      path: str) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

    tools_used = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, Ping):
                yield ": ping\n\n"
            elif isinstance(event, ContentDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ReasoningDelta):
                yield chunk({"reasoning_content": event.text})
            elif isinstance(event, ToolCallStart):
                tools_used = True
                yield chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                             "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallArgsDelta):
                yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
            elif isinstance(event, Finished):
                yield chunk({}, finish_reason(tools_used, event), timings=event.usage.timings())
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage_json(event)})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield sse(error_body(path, exc.status, exc.message))
    except Exception as exc:  # headers are sent: report in-band
        yield sse(error_body(path, 500, f"generation failed: {type(exc).__name__}: {exc}"))
    finally:
        await events.aclose()


async def completion_stream(events: AsyncIterator[Any], cid: str, created: int, model: str, include_usage: bool,
                            path: str) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})

    try:
        async for event in events:
            if isinstance(event, Ping):
                yield ": ping\n\n"
            elif isinstance(event, ContentDelta):
                yield chunk(event.text)
            elif isinstance(event, Finished):
                yield chunk("", _FINISH[event.reason])
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage_json(event)})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band
        yield sse(error_body(path, getattr(exc, "status", 500), str(exc)))
    finally:
        await events.aclose()
