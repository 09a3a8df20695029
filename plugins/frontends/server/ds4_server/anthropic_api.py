"""Anthropic Messages: content blocks, thinking, tool_use / tool_result, native streaming, count_tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart

from .common import Reply, ServerState, chat_prompt, collect, gen_request, new_id, parse_arguments, sampling, sse
from .errors import ApiError, error_body
from .generation import Finished, Ping
from .openai_api import MAX_INT, _Lenient, select_tools

_STOP = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountRequest(_Lenient):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=MAX_INT)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, le=MAX_INT, description="-1 or absent: a random seed")
    stop_sequences: list[str] | None = Field(None, max_length=16)


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise ApiError(400, f"{where}: expected a text block, got {kind!r}")
    return block["text"]


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: tool_result content must be a string or a list of text blocks")
    return "".join(_block_text(b, where) for b in content)


def chat_messages(body: CountRequest) -> list[dict[str, Any]]:
    """Anthropic system + messages as chat-format messages (tool results become tool messages)."""
    out: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(
            _block_text(b, "system") for b in body.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        message: dict[str, Any] = {"role": m.role, "content": ""}
        for j, block in enumerate(blocks):
            where, kind = f"messages[{i}].content[{j}]", block.get("type")
            if kind == "text":
                message["content"] += _block_text(block, where)
            elif kind == "thinking" and m.role == "assistant":
                message["reasoning_content"] = message.get("reasoning_content", "") + str(block.get("thinking", ""))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise ApiError(400, f"{where}: tool_use needs a string 'name'")
                message.setdefault("tool_calls", []).append({"id": str(block.get("id", "")), "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _tool_result_text(block.get("content"), where)})
            elif kind in ("image", "document"):
                raise ApiError(400, f"{where}: {kind} blocks are not supported by this server (text only)")
            else:
                raise ApiError(400, f"{where}: a {m.role} message cannot hold a block of type {kind!r}")
        if message["content"] or message.get("tool_calls") or message.get("reasoning_content") or not blocks:
            out.append(message)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for t in tools or ():
        if not isinstance(t.get("name"), str):
            raise ApiError(400, "every tool needs a string 'name'", param="tools")
        if "input_schema" in t or t.get("type") in (None, "custom"):
            out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema") or {}}})
    return out


def tool_choice(choice: dict[str, Any] | None) -> Any:
    kind = (choice or {}).get("type", "auto")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind, "auto")


def usage_json(finished: Finished) -> dict[str, Any]:
    u = finished.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": u.completion_tokens}


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    async def prepare(body: CountRequest) -> tuple[list[int], Any, str]:
        state.require_ready()
        enabled = None if body.thinking is None else body.thinking.get("type") == "enabled"
        thinking = state.thinking(enabled=enabled)
        tools = select_tools(chat_tools(body.tools), tool_choice(body.tool_choice))
        return await chat_prompt(state, chat_messages(body), tools, thinking), tools, thinking

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        pool = state.require_ready()
        model = state.check_model(body.model)
        prompt, tools, thinking = await prepare(body)
        parser = state.engine.chat_format.parser(thinking=thinking, tools=bool(tools))
        req = gen_request(state, prompt, body.max_tokens,
                          sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed),
                          body.stop_sequences, parser)
        mid = new_id("msg")
        events = await pool.start(req, ping_s=state.config.ping_s)
        if not body.stream:
            return message_response(await collect(events), mid, model)
        return StreamingResponse(_stream(events, mid, model, len(prompt), request.url.path),
                                 media_type="text/event-stream")

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest) -> dict[str, Any]:
        state.check_model(body.model)
        prompt, _, _ = await prepare(body)
        return {"input_tokens": len(prompt)}

    return api


def _stop_reason(has_tools: bool, finished: Finished) -> str:
    return "tool_use" if has_tools and finished.reason != "length" else _STOP[finished.reason]


def message_response(reply: Reply, mid: str, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["name"],
                        "input": parse_arguments(call["arguments"])})
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(bool(reply.tool_calls), reply.finished),
            "stop_sequence": reply.finished.stop_sequence, "usage": usage_json(reply.finished)}


async def _stream(events: AsyncIterator[Any], mid: str, model: str, n_prompt: int, path: str) -> AsyncIterator[str]:
    index, open_kind, tools_used = -1, None, False

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = stop()
        index, open_kind = index + 1, kind
        return [*out, sse({"type": "content_block_start", "index": index, "content_block": block},
                          "content_block_start")]

    def stop() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def delta(body: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": index, "delta": body}, "content_block_delta")

    try:
        yield sse({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}}, "message_start")
        async for event in events:
            out: list[str] = []
            if isinstance(event, Ping):
                out.append(sse({"type": "ping"}, "ping"))
            elif isinstance(event, ReasoningDelta):
                if open_kind != "thinking":
                    out += start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ContentDelta):
                if open_kind != "text":
                    out += start("text", {"type": "text", "text": ""})
                out.append(delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCallStart):
                tools_used = True
                out += start("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
            elif isinstance(event, ToolCallArgsDelta) and open_kind == "tool_use":
                out.append(delta({"type": "input_json_delta", "partial_json": event.text}))
            elif isinstance(event, Finished):
                out += stop()
                out.append(sse({"type": "message_delta", "delta": {
                    "stop_reason": _stop_reason(tools_used, event), "stop_sequence": event.stop_sequence},
                    "usage": usage_json(event)}, "message_delta"))
                out.append(sse({"type": "message_stop"}, "message_stop"))
            for chunk in out:
                yield chunk
    except Exception as exc:  # headers are sent: report as an SSE error event
        yield sse(error_body(path, getattr(exc, "status", 500), str(exc)), "error")
    finally:
        await events.aclose()
