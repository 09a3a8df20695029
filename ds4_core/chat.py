"""The chat contract between model plugins and frontends.

A model plugin's chat factory returns a :class:`ChatFormat`. Frontends give it
OpenAI-style message dicts and read back typed stream events, so the same
server and CLI serve every model family.

Messages are dicts with ``role`` in ``system | developer | user | assistant | tool``,
``content`` (a string), and optionally ``reasoning_content`` (assistant),
``tool_calls`` (assistant: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
with ``arguments`` a JSON string) and ``tool_call_id`` / ``name`` (tool).
Tools are OpenAI function definitions ``{"type": "function", "function": {"name", "description", "parameters"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs

from .errors import TemplateError

Thinking = Literal["none", "high", "max"]


@attrs.frozen
class ContentDelta:
    """Visible answer text."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Text of the model's reasoning (inside ``<think>`` or the family's equivalent)."""

    text: str


@attrs.frozen
class ToolCallStart:
    """A tool call ``index`` (0-based within the reply) has begun and its name is known."""

    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArgsDelta:
    """More of tool call ``index``'s JSON arguments; the concatenation is a JSON object."""

    index: int
    text: str


@attrs.frozen
class ToolCallEnd:
    """Tool call ``index`` is complete; ``arguments`` is its full JSON text."""

    index: int
    arguments: str


StreamEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


class StreamParser(Protocol):
    """Turns decoded text, pushed piece by piece, into stream events."""

    def feed(self, text: str) -> list[StreamEvent]:
        """Consume more generated text; return the events it completes."""

    def finish(self) -> list[StreamEvent]:
        """Flush at end of generation (incomplete tool calls become content)."""


class ChatFormat(Protocol):
    """A model family's prompt renderer and reply parser."""

    #: Literal strings that end generation (besides the tokenizer's EOS).
    stop_strings: tuple[str, ...]

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        thinking: Thinking = "none",
        add_generation_prompt: bool = True,
    ) -> str:
        """Render a conversation to prompt text; special tokens appear as their literal strings."""

    def parser(self, *, thinking: Thinking = "none", tools: bool = False) -> StreamParser:
        """A fresh parser for one reply rendered with the same ``thinking`` setting."""


class ReplyParser:
    """Splits a streamed reply into reasoning, then content or tool-call events.

    With ``thinking`` on, the prompt ended inside the reasoning block, so the reply is reasoning until the
    first ``think_close``; a ``tool_parser`` (the family's tool-call :class:`StreamParser`) then receives the
    rest, else it is plain content. Tool-call markup inside reasoning stays reasoning.
    """

    def __init__(self, *, thinking: Thinking = "none", tool_parser: StreamParser | None = None,
                 think_close: str = "</think>") -> None:
        self._in_reasoning = thinking != "none"
        self._close = think_close
        self._held = ""  # a possible start of the closing tag
        self._tool_parser = tool_parser

    def feed(self, text: str) -> list[StreamEvent]:
        """Consume more decoded text; return the events it completes."""
        events: list[StreamEvent] = []
        if self._in_reasoning:
            text, self._held = self._held + text, ""
            end = text.find(self._close)
            if end < 0:
                close = self._close
                held = next((n for n in range(len(close) - 1, 0, -1) if text.endswith(close[:n])), 0)
                text, self._held = text[:len(text) - held], text[len(text) - held:]
                return [ReasoningDelta(text)] if text else []
            if end:
                events.append(ReasoningDelta(text[:end]))
            self._in_reasoning, text = False, text[end + len(self._close):]
        if self._tool_parser is not None:
            return events + self._tool_parser.feed(text)
        return events + ([ContentDelta(text)] if text else [])

    def finish(self) -> list[StreamEvent]:
        """Flush held text; an unfinished tool call becomes content."""
        events: list[StreamEvent] = [ReasoningDelta(self._held)] if self._held else []
        self._held = ""
        if self._tool_parser is not None:
            events += self._tool_parser.finish()
        return events


def message_text(content: Any, where: str, reader: str) -> str:
    """Message ``content`` (None, a string, or OpenAI text parts) as one string; ``reader`` names the chat
    format in the error raised for a non-text part (an image, say)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise TemplateError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"{where}: {reader} reads only text; remove the content part of type {kind!r} "
                                "or convert it to {'type': 'text', 'text': ...}")
    return "".join(texts)
