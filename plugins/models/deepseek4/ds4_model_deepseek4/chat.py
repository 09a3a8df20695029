"""DeepSeek V4 chat format: prompt rendering and the streaming reply parser.

Prompt layout (spec §14): ``BOS`` · [Think-Max prefix] · merged system block (tool instructions
and schemas, then every system/developer message, joined by blank lines) · the turns · the
generation prompt. There are no separators between parts and no system marker token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_core.chat import ReplyParser, Thinking, message_text
from ds4_core.errors import TemplateError

from .dsml import DSML, ToolCallStreamParser, render_tool_calls

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: Inserted right after BOS for thinking="max" (the instruction DeepSeek's encoder uses).
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_INTRO = f"""## Tools

You can call the tools listed below. To call one or more tools, write a block of exactly this shape:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$OTHER_TOOL_NAME">
...
</{DSML}invoke>
</{DSML}tool_calls>

Write a string parameter as raw text and mark it `string="true"`. Keep its characters exactly as they are \
(`<`, `>`, `&`, `&&` included) and never turn them into XML or HTML entities; the one exception is the closing \
tag `</{DSML}parameter>` itself, which a value must spell `&lt;/{DSML}parameter>`. Write every other type \
(number, boolean, array, object) as JSON and mark it `string="false"`.

When thinking is on (the reply opens with <think>), finish all of your reasoning inside <think>...</think> \
before any tool call or final answer.

When thinking is off, write tool calls or the final answer right after </think>.

### Available Tool Schemas

"""
_TOOLS_OUTRO = "\n\nCall only the tools defined above, with exactly the parameter names and types their schemas give."

_THINKING_MODES = ("none", "high", "max")
_SYSTEM_ROLES = ("system", "developer")
_TOOL_ROLES = ("tool", "function")
_ROLES = (*_SYSTEM_ROLES, "user", "assistant", *_TOOL_ROLES)


def _text(content: Any, where: str) -> str:
    return message_text(content, where, "DeepSeek V4")


def _function_schemas(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Unwrap OpenAI ``{"type": "function", "function": {...}}`` tool definitions."""
    schemas = []
    for position, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(
                f"tool {position} is not a function definition; pass "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        schemas.append(function)
    return schemas


def _tools_prompt(schemas: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return _TOOLS_INTRO + lines + _TOOLS_OUTRO


def _tool_calls(message: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as ``[{"name", "arguments": dict}]``."""
    calls = []
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(
                f'{where}: tool call {position} needs {{"function": {{"name": ..., "arguments": ...}}}}'
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        # Arguments that are not a JSON object are kept verbatim in a single string parameter.
        if not isinstance(arguments, Mapping):
            arguments = {"arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}
        calls.append({"name": function["name"], "arguments": dict(arguments)})
    return calls


def _escape_tool_result(text: str) -> str:
    # Tool output is data kept verbatim; only its wrapper's closing tag must not appear literally.
    return text.replace("</tool_result>", "&lt;/tool_result>")


class DeepSeekV4Chat:
    """The DeepSeek V4 :class:`ds4_core.chat.ChatFormat`."""

    stop_strings: tuple[str, ...] = (EOS,)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: Thinking = "none",
        add_generation_prompt: bool = True,
    ) -> str:
        """Render OpenAI-style messages to prompt text with special tokens as literal strings.

        Reasoning of an assistant turn is kept only when thinking is on and either tools are in play
        (tools given, or tool calls / results in the history) or the turn follows the last user or
        tool message; otherwise the turn opens with a bare ``</think>``.
        """
        if thinking not in _THINKING_MODES:
            raise TemplateError(f"thinking must be one of {', '.join(_THINKING_MODES)}, got {thinking!r}")
        for position, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
                role = message.get("role") if isinstance(message, Mapping) else message
                raise TemplateError(f"message {position} has unknown role {role!r}; use one of {', '.join(_ROLES)}")
        schemas = _function_schemas(tools or ())
        think = thinking != "none"
        tool_context = bool(schemas) or any(
            message["role"] in _TOOL_ROLES or (message["role"] == "assistant" and message.get("tool_calls"))
            for message in messages
        )
        last_user = max(
            (i for i, message in enumerate(messages) if message["role"] in ("user", *_TOOL_ROLES)), default=-1
        )

        system = [_tools_prompt(schemas)] if schemas else []
        system += [
            _text(m.get("content"), f"message {i}") for i, m in enumerate(messages) if m["role"] in _SYSTEM_ROLES
        ]
        parts = [BOS, THINK_MAX_PREFIX if thinking == "max" else "", "\n\n".join(system)]

        in_tool_results = False
        for position, message in enumerate(messages):
            role, where = message["role"], f"message {position} ({message['role']})"
            content = _text(message.get("content"), where)
            if role in _TOOL_ROLES:
                if not in_tool_results:
                    parts.append(USER)
                parts.append(f"<tool_result>{_escape_tool_result(content)}</tool_result>")
            elif role == "user":
                parts += [USER, content]
            elif role == "assistant":
                reasoning = _text(message.get("reasoning_content"), where)
                keep_reasoning = think and (tool_context or position > last_user)
                opening = THINK_OPEN + reasoning + THINK_CLOSE if keep_reasoning else THINK_CLOSE
                parts += [ASSISTANT, opening, content, render_tool_calls(_tool_calls(message, where), schemas), EOS]
            if role not in _SYSTEM_ROLES:
                in_tool_results = role in _TOOL_ROLES

        if add_generation_prompt:
            parts += [ASSISTANT, THINK_OPEN if think else THINK_CLOSE]
        return "".join(parts)

    def parser(self, *, thinking: Thinking = "none", tools: bool = False) -> ReplyParser:
        """A fresh parser for one reply to a prompt rendered with this ``thinking`` setting."""
        return ReplyParser(thinking=thinking, tool_parser=ToolCallStreamParser() if tools else None,
                           think_close=THINK_CLOSE)
