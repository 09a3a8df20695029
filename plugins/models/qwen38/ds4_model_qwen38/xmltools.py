"""Qwen's XML tool calls: rendering, and a streaming parser of replies (reasoning, content, tool calls).

A call is written::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

String values are raw text, every other value JSON. Parsing has no schema, so a value that reads as a JSON
number, boolean, null, array or object is taken as that, anything else as a string.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from ds4_core.chat import ContentDelta, ReasoningDelta, StreamEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION_END = re.compile(r"\s*</function>\s*$")


def render_value(value: Any) -> str:
    """A parameter value as written inside ``<parameter=…>``: strings raw, the rest JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One ``<tool_call>`` block (no trailing newline)."""
    params = "".join(f"<parameter={key}>\n{render_value(value)}\n</parameter>\n" for key, value in arguments.items())
    return f"{CALL_OPEN}\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"


def parse_value(text: str) -> Any:
    """The inverse of :func:`render_value` without a schema (JSON non-strings, else the raw string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStreamParser:
    """The :class:`ds4_core.chat.StreamParser` of Qwen replies.

    ``reasoning``: the prompt ended inside ``<think>``, so the reply starts with reasoning up to ``</think>``.
    A tool call's events come when its parts are complete: the start once ``<function=NAME>`` is read, one
    argument delta per finished parameter, the end at ``</tool_call>``. An unfinished call becomes content.
    """

    def __init__(self, *, reasoning: bool, tools: bool):
        self._mode = "reasoning" if reasoning else "content"
        self._tools = tools
        self._buffer = ""
        self._strip_newlines = False  # at the start of content after </think>
        self._index = 0
        self._call_text = ""
        self._name: str | None = None  # of the open call, once its header is read
        self._args: dict[str, Any] = {}

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._run(final=True)
        if self._mode == "call":  # cut off inside a call: give the text back as content
            events.append(ContentDelta(self._call_text + self._buffer))
            self._mode, self._buffer, self._call_text, self._name = "content", "", "", None
        return events

    def _run(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            before = (self._mode, len(self._buffer))
            if self._mode == "reasoning":
                self._reasoning(events, final)
            elif self._mode == "content":
                self._content(events, final)
            else:
                self._call(events)
            if (self._mode, len(self._buffer)) == before:
                return events

    def _reasoning(self, events: list[StreamEvent], final: bool) -> None:
        end = self._buffer.find(THINK_CLOSE)
        if end >= 0:
            text = self._buffer[:end].rstrip("\n")
            self._buffer = self._buffer[end + len(THINK_CLOSE):]
            self._mode, self._strip_newlines = "content", True
        else:
            keep = 0 if final else _held_prefix(self._buffer, THINK_CLOSE)
            text = self._buffer[:len(self._buffer) - keep]
            if not final:  # newlines may be the ones before </think>
                text = text.rstrip("\n")
            self._buffer = self._buffer[len(text):]
        if text:
            events.append(ReasoningDelta(text))

    def _content(self, events: list[StreamEvent], final: bool) -> None:
        if self._strip_newlines:
            stripped = self._buffer.lstrip("\n")
            if stripped or final:
                self._strip_newlines = False
            self._buffer = stripped
        start = self._buffer.find(CALL_OPEN) if self._tools else -1
        if start >= 0:
            text = self._buffer[:start].rstrip("\n")  # the blank line that separates content from calls
            self._buffer = self._buffer[start + len(CALL_OPEN):]
            self._mode, self._call_text = "call", CALL_OPEN
        else:
            keep = 0 if final or not self._tools else _held_prefix(self._buffer, CALL_OPEN)
            text = self._buffer[:len(self._buffer) - keep]
            if self._tools and not final:
                text = text.rstrip("\n")
            self._buffer = self._buffer[len(text):]
        if text:
            events.append(ContentDelta(text))

    def _call(self, events: list[StreamEvent]) -> None:
        """Consume complete pieces of the open call: function header, parameters, then the closing tags."""
        if self._name is None:
            match = _FUNCTION.match(self._buffer)
            if match is None:
                return
            self._name, self._args = match.group(1).strip(), {}
            events.append(ToolCallStart(self._index, f"call_{self._index}_{secrets.token_hex(8)}", self._name))
            self._consume(match.end())
        while (match := _PARAMETER.match(self._buffer)) is not None:
            key, value = match.group(1).strip(), parse_value(match.group(2))
            prefix = "{" if not self._args else ", "
            self._args[key] = value
            events.append(ToolCallArgsDelta(self._index, f"{prefix}{json.dumps(key)}: "
                                                         f"{json.dumps(value, ensure_ascii=False)}"))
            self._consume(match.end())
        end = self._buffer.find(CALL_CLOSE)
        if end >= 0 and _FUNCTION_END.match(self._buffer[:end]):
            arguments = json.dumps(self._args, ensure_ascii=False)
            events.append(ToolCallArgsDelta(self._index, "}" if self._args else "{}"))
            events.append(ToolCallEnd(self._index, arguments))
            self._buffer = self._buffer[end + len(CALL_CLOSE):].lstrip("\n")
            self._index += 1
            self._mode, self._call_text, self._name = "content", "", None

    def _consume(self, n: int) -> None:
        self._call_text += self._buffer[:n]
        self._buffer = self._buffer[n:]
