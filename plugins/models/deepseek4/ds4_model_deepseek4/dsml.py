"""DSML, DeepSeek V4's tool-call markup: rendering, and parsing that works on streamed text.

A block looks like this (``｜DSML｜`` is one token)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="Q" string="false">{"json": 1}</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The parser also accepts the tag prefix without its first bar (``<DSML｜tool_calls>``) and plain
``<tool_calls>`` / ``<invoke>`` / ``<parameter>`` tags, which the model sometimes drifts into.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_core.chat import ContentDelta, StreamEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

DSML = "｜DSML｜"
#: Tag prefixes the parser accepts, canonical first.
TAG_STYLES = (DSML, "DSML｜", "")
_OPENERS = tuple(f"<{style}tool_calls>" for style in TAG_STYLES)
_CLOSE_PARAMETER = f"</{DSML}parameter>"

_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY_RE = re.compile("|".join(_ENTITIES))
# An ampersand that would read back as an entity; rendering escapes it so parse(render(x)) == x.
_AMBIGUOUS_AMPERSAND_RE = re.compile(r"&(?=(?:amp|lt|gt|quot|apos);)")
_ATTRIBUTE_RE = re.compile(r'([A-Za-z_][\w-]*)\s*=\s*"([^"]*)"')


# ---------------------------------------------------------------------------------------------- rendering


def _escape_attribute(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _escape_string_value(text: str) -> str:
    text = _AMBIGUOUS_AMPERSAND_RE.sub("&amp;", text)
    return text.replace(_CLOSE_PARAMETER, "&lt;" + _CLOSE_PARAMETER[1:])


def _json_value(value: Any) -> str:
    # '<' only occurs inside JSON strings, where \u003c is an equivalent spelling.
    return json.dumps(value, ensure_ascii=False).replace(_CLOSE_PARAMETER, "\\u003c" + _CLOSE_PARAMETER[1:])


def schema_property_order(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, list[str]]:
    """Map each tool name to its parameter names in schema order.

    ``tools`` holds OpenAI tool definitions (``{"type": "function", "function": {...}}``) or bare
    function schemas (``{"name", "parameters"}``); entries without a name are skipped.
    """
    order: dict[str, list[str]] = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        order[name] = list(properties) if isinstance(properties, Mapping) else []
    return order


def render_tool_calls(calls: Sequence[Mapping[str, Any]], schemas: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Render tool calls as a DSML block, or ``""`` when there are none.

    ``calls`` is a list of ``{"name": str, "arguments": dict}``; ``schemas`` are the tool definitions
    whose property order the parameters follow (unknown parameters come after, in dict order).
    Strings are written raw with ``string="true"``, every other value as JSON with ``string="false"``.
    The block starts with a blank line and ends with the closing ``tool_calls`` tag (no newline).
    """
    if not calls:
        return ""
    order = schema_property_order(schemas)
    lines = ["", "", f"<{DSML}tool_calls>"]
    for call in calls:
        arguments = call["arguments"]
        known = [key for key in order.get(call["name"], ()) if key in arguments]
        lines.append(f'<{DSML}invoke name="{_escape_attribute(call["name"])}">')
        for key in known + [key for key in arguments if key not in known]:
            value = arguments[key]
            is_string = isinstance(value, str)
            text = _escape_string_value(value) if is_string else _json_value(value)
            lines.append(
                f'<{DSML}parameter name="{_escape_attribute(key)}" string="{"true" if is_string else "false"}">'
                f"{text}</{DSML}parameter>"
            )
        lines.append(f"</{DSML}invoke>")
    lines.append(f"</{DSML}tool_calls>")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ parsing


def decode_entities(text: str) -> str:
    """Decode ``&amp; &lt; &gt; &quot; &apos;`` (other ampersands stay as they are)."""
    return _ENTITY_RE.sub(lambda match: _ENTITIES[match.group()], text)


def _held_suffix(text: str, candidates: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``candidates``."""
    longest = 0
    for candidate in candidates:
        for size in range(min(len(candidate) - 1, len(text)), longest, -1):
            if text.endswith(candidate[:size]):
                longest = size
                break
    return longest


def _entity_safe_length(text: str) -> int:
    """Length of the prefix of ``text`` that cannot end inside a still-growing entity."""
    amp = text.rfind("&", max(0, len(text) - 5))
    tail = text[amp:]
    if amp >= 0 and any(entity.startswith(tail) and entity != tail for entity in _ENTITIES):
        return amp
    return len(text)


def _json_text(raw: str) -> str:
    """A ``string="false"`` value as JSON text; values that are not valid JSON become strings."""
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


def _new_call_id(index: int) -> str:
    return f"call_{index}_{secrets.token_hex(8)}"


class _Malformed(Exception):
    """The block in progress is not valid DSML; its raw text becomes content."""


_NEED_MORE = object()


class ToolCallStreamParser:
    """Splits visible reply text into content and DSML tool calls, fed in pieces of any size.

    Events: ``ContentDelta`` for visible text (text that might begin a tag, and trailing whitespace,
    is held until resolved; whitespace before a block or between a block and the reply's end is
    dropped), ``ToolCallStart`` when an invoke's name is known, ``ToolCallArgsDelta`` as its
    arguments stream (string values as they arrive), and ``ToolCallEnd`` at ``</invoke>`` with the
    full JSON text. Call ids are ``call_<index>_<16 random hex>``.

    Malformed or truncated DSML: calls already ended stay; the raw text from the start of the block
    (or of the first unfinished invoke) is emitted as content and the rest of the reply is plain
    content. A call whose ``ToolCallStart`` has no ``ToolCallEnd`` was abandoned that way.
    """

    def __init__(self) -> None:
        self._buffer = ""  # text received but not consumed yet
        self._state = "content"
        self._events: list[StreamEvent] = []
        self._after_block = False  # whitespace between a block and the end of the reply is dropped
        self._style = ""
        self._raw = ""  # consumed text since the last point a failure would rewind to
        self._index = 0
        self._arguments = ""  # JSON text of the call in progress
        self._first_argument = True
        self._nested: dict[str, Any] = {}
        self._key = ""
        self._searched = 0  # how far a value's closing tag was already searched for

    # ---- public protocol

    def feed(self, text: str) -> list[StreamEvent]:
        """Consume more reply text; return the events it completes."""
        self._buffer += text
        self._run(final=False)
        return self._take_events()

    def finish(self) -> list[StreamEvent]:
        """Flush at end of generation: held text is emitted, an unfinished block becomes content."""
        self._run(final=True)
        return self._take_events()

    # ---- machinery

    def _take_events(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events

    def _run(self, final: bool) -> None:
        handlers = {
            "content": self._content,
            "block": self._block,
            "invoke": self._invoke,
            "undetermined": self._undetermined,
            "string": self._string_value,
            "json": self._json_value,
            "nested": self._nested_object,
            "passthrough": self._passthrough,
        }
        while True:
            try:
                progressed = handlers[self._state](final)
            except _Malformed:
                self._state, self._buffer = "passthrough", self._raw + self._buffer
                progressed = True
            if not progressed:
                return

    def _emit_content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))
            self._after_block = False

    def _emit_arguments(self, text: str) -> None:
        self._arguments += text
        self._events.append(ToolCallArgsDelta(self._index, text))

    def _consume(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        self._raw += taken
        return taken

    def _tag(self, name: str) -> str:
        return f"<{self._style}{name}"

    def _end_tag(self, name: str) -> str:
        return f"</{self._style}{name}>"

    def _skip_structural_whitespace(self) -> bool:
        """Consume leading whitespace; True when something else follows it."""
        stripped = self._buffer.lstrip()
        self._consume(len(self._buffer) - len(stripped))
        return bool(self._buffer)

    def _first_match(self, literals: Sequence[str], final: bool) -> str | object:
        """The literal the buffer starts with, ``_NEED_MORE``, or raise when none can match."""
        pending = False
        for literal in literals:
            if self._buffer.startswith(literal):
                return literal
            pending = pending or literal.startswith(self._buffer)
        if pending and not final:
            return _NEED_MORE
        raise _Malformed

    def _read_open_tag(self, name: str, final: bool) -> dict[str, str] | None:
        """Consume ``<STYLEname attrs>`` at the buffer start; None until its ``>`` has arrived."""
        head = self._tag(name)
        end = self._buffer.find(">", len(head))
        if end < 0:
            if final:
                raise _Malformed
            return None
        body = self._buffer[len(head) : end]
        if body and not body[0].isspace():
            raise _Malformed
        attributes = {key: decode_entities(value) for key, value in _ATTRIBUTE_RE.findall(body)}
        if "name" not in attributes:
            raise _Malformed
        self._consume(end + 1)
        return attributes

    # ---- states; each returns whether it made progress

    def _content(self, final: bool) -> bool:
        found = [(self._buffer.find(opener), style) for opener, style in zip(_OPENERS, TAG_STYLES, strict=True)]
        found = [(position, style) for position, style in found if position >= 0]
        if found:
            position, style = min(found)
            before = self._buffer[:position]
            visible = before.rstrip()
            self._emit_content(visible)
            self._buffer = self._buffer[len(visible) :]
            self._raw, self._style = "", style
            self._consume(len(before) - len(visible) + len(_OPENERS[TAG_STYLES.index(style)]))
            self._state = "block"
            return True
        if final:
            self._emit_content("" if self._after_block and self._buffer.isspace() else self._buffer)
            self._buffer = ""
            return False
        safe = self._buffer[: len(self._buffer) - _held_suffix(self._buffer, _OPENERS)]
        visible = safe.rstrip()
        self._emit_content(visible)
        self._buffer = self._buffer[len(visible) :]
        return False

    def _block(self, final: bool) -> bool:
        if not self._skip_structural_whitespace():
            # A reply that ends right after a complete invoke lost only its closing tag: accept it.
            if final and self._raw.strip():
                raise _Malformed
            return False
        matched = self._first_match((self._end_tag("tool_calls"), self._tag("invoke")), final)
        if matched is _NEED_MORE:
            return False
        if matched == self._end_tag("tool_calls"):
            self._consume(len(matched))
            self._state, self._after_block = "content", True
            return True
        attributes = self._read_open_tag("invoke", final)
        if attributes is None:
            return False
        self._events.append(ToolCallStart(self._index, _new_call_id(self._index), attributes["name"]))
        self._arguments, self._first_argument = "", True
        self._emit_arguments("{")
        self._state = "invoke"
        return True

    def _invoke(self, final: bool) -> bool:
        if not self._skip_structural_whitespace():
            if final:
                raise _Malformed
            return False
        matched = self._first_match((self._end_tag("invoke"), self._tag("parameter")), final)
        if matched is _NEED_MORE:
            return False
        if matched == self._end_tag("invoke"):
            self._consume(len(matched))
            self._end_call()
            return True
        attributes = self._read_open_tag("parameter", final)
        if attributes is None:
            return False
        self._key, self._searched = attributes["name"], 0
        kind = attributes.get("string")
        if kind is None:
            self._state = "undetermined"
        elif kind == "true":
            self._start_string_value()
        else:
            self._state = "json"
        return True

    def _end_call(self) -> None:
        self._emit_arguments("}")
        self._events.append(ToolCallEnd(self._index, self._arguments))
        self._index += 1
        self._raw = ""
        self._state = "block"

    def _key_prefix(self) -> str:
        prefix = "" if self._first_argument else ", "
        self._first_argument = False
        return prefix + json.dumps(self._key, ensure_ascii=False) + ": "

    def _start_string_value(self) -> None:
        self._emit_arguments(self._key_prefix() + '"')
        self._state = "string"

    def _undetermined(self, final: bool) -> bool:
        """A parameter without a ``string`` attribute: nested parameters make an object, else a string."""
        rest = self._buffer.lstrip()
        nested_head = self._tag("parameter")
        if rest.startswith(nested_head):
            self._consume(len(self._buffer) - len(rest))
            self._nested, self._state = {}, "nested"
            return True
        if (not rest or nested_head.startswith(rest)) and not final:
            return False
        self._start_string_value()
        return True

    def _find_close(self, final: bool) -> int:
        """Index of the closing parameter tag in the buffer, or -1; raises at the end of the reply."""
        close = self._end_tag("parameter")
        position = self._buffer.find(close, max(0, self._searched - len(close)))
        self._searched = len(self._buffer)
        if position < 0 and final:
            raise _Malformed
        return position

    def _string_value(self, final: bool) -> bool:
        close = self._find_close(final)
        raw = self._buffer if close < 0 else self._buffer[:close]
        if close < 0:
            raw = raw[: len(raw) - _held_suffix(raw, (self._end_tag("parameter"),))]
            raw = raw[: _entity_safe_length(raw)]
        text = json.dumps(decode_entities(raw), ensure_ascii=False)[1:-1]
        self._consume(len(raw))
        self._searched = 0
        if close < 0:
            if text:
                self._emit_arguments(text)
            return False
        self._consume(len(self._end_tag("parameter")))
        self._emit_arguments(text + '"')
        self._state = "invoke"
        return True

    def _json_value(self, final: bool) -> bool:
        close = self._find_close(final)
        if close < 0:
            return False
        raw = self._consume(close)
        self._consume(len(self._end_tag("parameter")))
        self._emit_arguments(self._key_prefix() + _json_text(raw))
        self._state = "invoke"
        return True

    def _nested_object(self, final: bool) -> bool:
        """Leaf parameters inside a parameter, closed by ``</parameter>`` (or, leniently, ``</invoke>``)."""
        if not self._skip_structural_whitespace():
            if final:
                raise _Malformed
            return False
        ends = (self._end_tag("parameter"), self._end_tag("invoke"))
        matched = self._first_match((*ends, self._tag("parameter")), final)
        if matched is _NEED_MORE:
            return False
        if matched in ends:
            self._consume(len(matched))
            self._emit_arguments(self._key_prefix() + json.dumps(self._nested, ensure_ascii=False))
            if matched == self._end_tag("invoke"):
                self._end_call()
            else:
                self._state = "invoke"
            return True
        head_end = self._buffer.find(">")
        close = self._buffer.find(self._end_tag("parameter"), head_end + 1) if head_end >= 0 else -1
        if close < 0:
            if final:
                raise _Malformed
            return False
        attributes = self._read_open_tag("parameter", final)
        raw = self._consume(close - (head_end + 1))
        self._consume(len(self._end_tag("parameter")))
        if attributes.get("string", "true") == "true":
            self._nested[attributes["name"]] = decode_entities(raw)
        else:
            self._nested[attributes["name"]] = json.loads(_json_text(raw))
        return True

    def _passthrough(self, final: bool) -> bool:
        self._emit_content(self._buffer)
        self._buffer = self._raw = ""
        return False


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Parse a complete visible reply: ``(visible_text, [{"name": str, "arguments": dict}, ...])``.

    Same rules as :class:`ToolCallStreamParser` (it runs one): content before a block has its
    trailing whitespace trimmed, malformed DSML is returned as visible text.
    """
    parser = ToolCallStreamParser()
    events = parser.feed(text) + parser.finish()
    names = {event.index: event.name for event in events if isinstance(event, ToolCallStart)}
    visible = "".join(event.text for event in events if isinstance(event, ContentDelta))
    calls = [
        {"name": names[event.index], "arguments": json.loads(event.arguments)}
        for event in events
        if isinstance(event, ToolCallEnd)
    ]
    return visible, calls
