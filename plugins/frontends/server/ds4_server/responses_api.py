"""OpenAI Responses: input items, reasoning and function-call items, streaming events, ``previous_response_id``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

from .common import ServerState, arguments_text, chat_prompt, collect, gen_request, new_id, sampling, sse, text_of
from .errors import ApiError, error_body
from .generation import Finished, Ping
from .openai_api import MAX_INT, MAX_TOP_LOGPROBS, _Lenient, select_tools


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool = False
    store: bool = True
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1, le=MAX_INT, description="-1 or absent: a random seed")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation in chat-format messages: instructions, then the input items in order."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    reasoning = ""
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"{where}: role must be system, developer, user or assistant, got {role!r}",
                               param="input")
            message = {"role": role, "content": text_of(item.get("content"), what=where)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "reasoning":
            parts = [p for key in ("content", "summary") if isinstance(item.get(key), list) for p in item[key]]
            reasoning += "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise ApiError(400, f"{where}: a function_call needs a string 'name'", param="input")
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": item["name"], "arguments": arguments_text(item.get("arguments", ""))}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": output if isinstance(output, str) else text_of(output, what=where)})
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses function tools as chat-format tools (other tool kinds are hosted tools this server lacks)."""
    out = []
    for t in tools or ():
        if t.get("type") == "function" and isinstance(t.get("name"), str):
            out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("parameters") or {}}})
    return out


class ResponseBuilder:
    """Turns stream events into Responses output items and, when streaming, their SSE events."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest):
        self.rid, self.model, self.body = rid, model, body
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, event=kind)

    def response(self, status: str, finished: Finished | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output, "error": None, "incomplete_details": None, "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens, "previous_response_id": self.body.previous_response_id,
            "parallel_tool_calls": True, "tool_choice": self.body.tool_choice or "auto",
            "tools": self.body.tools or [], "store": self.body.store, "metadata": {},
            "text": {"format": {"type": "text"}}, "temperature": self.body.temperature, "top_p": self.body.top_p,
            "usage": None}
        if finished is not None:
            u = finished.usage
            reasoning_tokens = sum(1 for item in self.output if item["type"] == "reasoning")
            out["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                            "output_tokens": u.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": reasoning_tokens and u.completion_tokens},
                            "total_tokens": u.prompt_tokens + u.completion_tokens}
            out["timings"] = u.timings()
            if finished.reason == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return out

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        self.output.append(item)
        idx = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=idx, item=dict(item, content=[])
                             if item["type"] != "function_call" else dict(item))]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = len(self.output) - 1
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=idx, name=item["name"], arguments=item["arguments"]))
        return [*events, self.event("response.output_item.done", output_index=idx, item=item)]

    def add(self, event: Any) -> list[str]:
        """Apply one stream event; return the SSE events it produces."""
        out: list[str] = []
        kind = self.open["type"] if self.open else None
        if isinstance(event, ReasoningDelta):
            if kind != "reasoning":
                out += self.close()
                out += self._open({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            self.open["content"][0]["text"] += event.text
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=event.text))
        elif isinstance(event, ContentDelta):
            if kind != "message":
                out += self.close()
                out += self._open({"type": "message", "id": new_id("msg"), "role": "assistant",
                                   "status": "in_progress",
                                   "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.open["content"][0]["text"] += event.text
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=event.text, logprobs=[]))
        elif isinstance(event, ToolCallStart):
            out += self.close()
            out += self._open({"type": "function_call", "id": new_id("fc"), "call_id": event.id, "name": event.name,
                               "arguments": "", "status": "in_progress"})
        elif isinstance(event, ToolCallArgsDelta) and kind == "function_call":
            self.open["arguments"] += event.text
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, delta=event.text))
        elif isinstance(event, ToolCallEnd) and kind == "function_call":
            self.open["arguments"] = event.arguments
            out += self.close()
        return out

    def assistant_message(self) -> dict[str, Any]:
        """The reply as a chat-format assistant message, stored for continuations."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = message.get("reasoning_content", "") + item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return message


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    async def prepare(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[int], list | None, str]:
        state.require_ready()
        history = list(state.responses.get(body.previous_response_id)) if body.previous_response_id else []
        messages = history + input_messages(body)
        if not messages:
            raise ApiError(400, "input is empty; give a string or a list of input items", param="input")
        tools = select_tools(chat_tools(body.tools), body.tool_choice)
        effort = (body.reasoning or {}).get("effort")
        thinking = state.thinking(effort=effort)
        return messages, await chat_prompt(state, messages, tools, thinking), tools, thinking

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        pool = state.require_ready()
        model = state.check_model(body.model)
        messages, prompt, tools, thinking = await prepare(body)
        parser = state.engine.chat_format.parser(thinking=thinking, tools=bool(tools))
        req = gen_request(state, prompt, body.max_output_tokens,
                          sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed), None, parser)
        builder = ResponseBuilder(new_id("resp"), model, body)
        events = await pool.start(req, ping_s=state.config.ping_s)

        def remember() -> None:
            if body.store:
                state.responses.put(builder.rid, [*messages, builder.assistant_message()])

        if not body.stream:
            reply = await collect(events)
            for event in _replay(reply):
                builder.add(event)
            builder.close()
            remember()
            return builder.response("completed", reply.finished)
        return StreamingResponse(_stream(builder, events, remember, request.url.path), media_type="text/event-stream")

    @api.post("/v1/responses/input_tokens")
    async def input_tokens(body: ResponsesRequest) -> dict[str, Any]:
        state.check_model(body.model)
        _, prompt, _, _ = await prepare(body)
        return {"object": "response.input_tokens", "input_tokens": len(prompt)}

    return api


def _replay(reply: Any) -> list[Any]:
    """A collected reply as the event order a stream would have had (reasoning, text, then calls)."""
    events: list[Any] = []
    if reply.reasoning:
        events.append(ReasoningDelta(reply.reasoning))
    if reply.content:
        events.append(ContentDelta(reply.content))
    for i, call in enumerate(reply.tool_calls):
        events += [ToolCallStart(i, call["id"], call["name"]), ToolCallArgsDelta(i, call["arguments"]),
                   ToolCallEnd(i, call["arguments"])]
    return events


async def _stream(builder: ResponseBuilder, events: AsyncIterator[Any], remember: Any, path: str) -> AsyncIterator[str]:
    try:
        yield builder.event("response.created", response=builder.response("in_progress"))
        yield builder.event("response.in_progress", response=builder.response("in_progress"))
        async for event in events:
            if isinstance(event, Ping):
                yield ": ping\n\n"
            elif isinstance(event, Finished):
                for chunk in builder.close():
                    yield chunk
                remember()
                final = builder.response("completed", event)
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                yield builder.event(kind, response=final)
            else:
                for chunk in builder.add(event):
                    yield chunk
    except Exception as exc:  # headers are sent: report in-band
        body = error_body(path, getattr(exc, "status", 500), str(exc))["error"]
        yield builder.event("error", code=str(body["code"]), message=body["message"], param=None)
    finally:
        await events.aclose()
