"""GLM's XML-ish tool-call markup: rendering, and a parser that works on streamed text (spec §9.3).

A call is ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>``; several calls may
follow each other. VALUE is raw text: strings verbatim, other JSON types as JSON. Whitespace between the parts
(GLM-4.5/4.6 put newlines there) is tolerated.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_core.chat import ContentDelta, StreamEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
_PAIR_RE = re.compile(re.escape(KEY_OPEN) + r"(.*?)" + re.escape(KEY_CLOSE) + r"\s*" + re.escape(VALUE_OPEN) +
                      r"(.*?)" + re.escape(VALUE_CLOSE), re.DOTALL)
_NAME_RE = re.compile(r"[^\s<>]+")


def render_value(value: Any) -> str:
    """An argument as GLM writes it: a string verbatim, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One ``<tool_call>`` block for ``name`` with ``arguments`` in dict order."""
    pairs = "".join(f"{KEY_OPEN}{key}{KEY_CLOSE}{VALUE_OPEN}{render_value(value)}{VALUE_CLOSE}"
                    for key, value in arguments.items())
    return f"{CALL_OPEN}{name}{pairs}{CALL_CLOSE}"


def string_parameters(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, set[str]]:
    """Tool name -> its parameters whose schema type is ``"string"`` (kept verbatim even if they look like JSON)."""
    out: dict[str, set[str]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            out[function["name"]] = {k for k, v in properties.items() if isinstance(v, Mapping)
                                     and v.get("type") == "string"}
    return out


def parse_value(text: str, keep_string: bool) -> Any:
    """An argument's value: JSON when it parses and the schema does not say string, else the raw text."""
    if not keep_string:
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class ToolCallStreamParser:
    """Splits visible reply text into content and tool calls, fed in pieces of any size.

    Events: ``ContentDelta`` for text outside calls (text that might begin ``<tool_call>`` is held until resolved),
    ``ToolCallStart`` once a call's name is complete, one ``ToolCallArgsDelta`` per complete key/value pair, and
    ``ToolCallEnd`` at ``</tool_call>`` with the full JSON object. Malformed or truncated calls: the raw text from
    the call's ``<tool_call>`` is emitted as content (a ``ToolCallStart`` without ``ToolCallEnd`` was abandoned).
    Call ids are ``call_<index>_<16 random hex>``.
    """

    def __init__(self, string_params: Mapping[str, set[str]] | None = None) -> None:
        self._string_params = dict(string_params or {})
        self._buffer = ""
        self._in_call = False
        self._raw = ""  # the current call's text consumed so far, replayed as content if it turns out malformed
        self._name: str | None = None
        self._arguments: dict[str, Any] = {}
        self._index = 0

    def feed(self, text: str) -> list[StreamEvent]:
        """Consume more reply text; return the events it completes."""
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[StreamEvent]:
        """Flush at end of generation: held text is emitted, an unfinished call becomes content."""
        events = self._run(final=True)
        if self._in_call:
            events.append(ContentDelta(self._raw + self._buffer))
            self._in_call, self._buffer, self._raw = False, "", ""
        return events

    def _run(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            step = self._call_step(events) if self._in_call else self._content_step(events, final)
            if not step:
                return events

    def _content_step(self, events: list[StreamEvent], final: bool) -> bool:
        start = self._buffer.find(CALL_OPEN)
        if start < 0:
            keep = 0 if final else _partial_suffix(self._buffer, CALL_OPEN)
            text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            if text:
                events.append(ContentDelta(text))
            return False
        if start:
            events.append(ContentDelta(self._buffer[:start]))
        self._buffer = self._buffer[start + len(CALL_OPEN):]
        self._in_call, self._raw, self._name, self._arguments = True, CALL_OPEN, None, {}
        return True

    def _consume(self, n: int) -> None:
        self._raw += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _call_step(self, events: list[StreamEvent]) -> bool:
        if self._name is None:
            ends = [i for i in (self._buffer.find(KEY_OPEN), self._buffer.find(CALL_CLOSE)) if i >= 0]
            if not ends:
                return False
            name = self._buffer[:min(ends)].strip()
            if not _NAME_RE.fullmatch(name):
                return self._abandon(events)
            self._name = name
            self._consume(min(ends))
            events.append(ToolCallStart(self._index, f"call_{self._index}_{secrets.token_hex(8)}", name))
            return True
        rest = self._buffer.lstrip()
        skipped = len(self._buffer) - len(rest)
        if rest.startswith(CALL_CLOSE):
            self._consume(skipped + len(CALL_CLOSE))
            arguments = json.dumps(self._arguments, ensure_ascii=False)
            if not self._arguments:
                events.append(ToolCallArgsDelta(self._index, arguments))
            else:
                events.append(ToolCallArgsDelta(self._index, "}"))
            events.append(ToolCallEnd(self._index, arguments))
            self._index += 1
            self._in_call, self._raw = False, ""
            return True
        match = _PAIR_RE.match(rest)
        if match:
            key = match.group(1).strip()
            value = parse_value(match.group(2), key in self._string_params.get(self._name, set()))
            prefix = "{" if not self._arguments else ", "
            self._arguments[key] = value
            events.append(ToolCallArgsDelta(self._index, f"{prefix}{json.dumps(key)}: "
                                                         f"{json.dumps(value, ensure_ascii=False)}"))
            self._consume(skipped + match.end())
            return True
        if not rest or KEY_OPEN.startswith(rest[:len(KEY_OPEN)]) or CALL_CLOSE.startswith(rest):
            return False  # a part still arriving
        return self._abandon(events)

    def _abandon(self, events: list[StreamEvent]) -> bool:
        """A malformed call: replay its raw text as content and go back to plain text."""
        events.append(ContentDelta(self._raw + self._buffer))
        self._in_call, self._buffer, self._raw = False, "", ""
        return False
