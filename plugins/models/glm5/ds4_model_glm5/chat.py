"""GLM 5.x chat format (both families): prompt rendering and the streaming reply parser (spec §9.2).

Prompt layout: ``[gMASK]<sop>`` · [``<|system|>Reasoning Effort: High|Max`` when thinking] · [``<|system|>`` tools
preamble] · the messages, each opened by its role token (no newlines, no end-of-turn token) · the generation prompt
``<|assistant|><think>`` (thinking) or ``<|assistant|><think></think>``. Assistant turns keep their reasoning
("preserved thinking"); consecutive tool results share one ``<|observation|>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_core.chat import ReplyParser, Thinking, message_text
from ds4_core.errors import TemplateError

from .toolcall import ToolCallStreamParser, render_tool_call, string_parameters

PREFIX = "[gMASK]<sop>"
SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
ENDOFTEXT = "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: ``thinking`` setting -> the reasoning-effort word of the system line (omitted when thinking is off).
EFFORT = {"high": "High", "max": "Max"}

TOOLS_INTRO = ("\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, output the function name and arguments within the following "
               "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
               "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>")

_SYSTEM_ROLES = ("system", "developer")
_TOOL_ROLES = ("tool", "function")
_ROLES = (*_SYSTEM_ROLES, "user", "assistant", *_TOOL_ROLES)


def _text(content: Any, where: str) -> str:
    return message_text(content, where, "the GLM chat format")


def _function_schemas(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The *function* objects of OpenAI tool definitions (the ``{"type": "function"}`` wrapper dropped)."""
    schemas = []
    for position, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"tool {position} is not a function definition; pass "
                                '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        schemas.append({k: v for k, v in function.items() if k != "strict"})
    return schemas


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``<|system|>`` block listing ``tools``, one JSON object per line."""
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in _function_schemas(tools))
    return SYSTEM + TOOLS_INTRO + lines + TOOLS_OUTRO


def _tool_calls(message: Mapping[str, Any], where: str) -> str:
    """An assistant message's OpenAI ``tool_calls`` rendered as ``<tool_call>`` blocks."""
    out = []
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"{where}: tool call {position} needs "
                                '{"function": {"name": ..., "arguments": ...}}')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise TemplateError(f"{where}: tool call {position} arguments are not JSON: {arguments[:80]!r}") \
                    from None
        if not isinstance(arguments, Mapping):
            raise TemplateError(f"{where}: tool call {position} arguments must be a JSON object")
        out.append(render_tool_call(function["name"], arguments))
    return "".join(out)


class GlmChat:
    """The GLM 5.x :class:`ds4_core.chat.ChatFormat`."""

    #: A turn ends where the model opens the next role (there is no end-of-turn token), or at end of text.
    stop_strings: tuple[str, ...] = (ENDOFTEXT, USER, OBSERVATION, SYSTEM, ASSISTANT)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: Thinking = "none",
        add_generation_prompt: bool = True,
    ) -> str:
        """Render OpenAI-style messages to prompt text with special tokens as literal strings."""
        if thinking not in ("none", *EFFORT):
            raise TemplateError(f"thinking must be one of none, {', '.join(EFFORT)}, got {thinking!r}")
        parts = [PREFIX]
        if thinking != "none":
            parts.append(f"{SYSTEM}Reasoning Effort: {EFFORT[thinking]}")
        if tools:
            parts.append(tools_prompt(tools))
        in_results = False
        for position, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if role not in _ROLES:
                raise TemplateError(f"message {position} has unknown role {role!r}; use one of {', '.join(_ROLES)}")
            where = f"message {position} ({role})"
            content = _text(message.get("content"), where)
            if role in _TOOL_ROLES:
                parts += [] if in_results else [OBSERVATION]
                parts.append(f"<tool_response>{content}</tool_response>")
            elif role in _SYSTEM_ROLES:
                parts += [SYSTEM, content]
            elif role == "user":
                parts += [USER, content]
            else:
                reasoning = message.get("reasoning_content")
                if reasoning is None and THINK_CLOSE in content:  # reasoning left inline in the content
                    head, _, content = content.rpartition(THINK_CLOSE)
                    reasoning = head.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1]
                parts += [ASSISTANT, THINK_OPEN, _text(reasoning, where), THINK_CLOSE, content.strip(),
                          _tool_calls(message, where)]
            in_results = role in _TOOL_ROLES
        if add_generation_prompt:
            parts += [ASSISTANT, THINK_OPEN if thinking != "none" else THINK_OPEN + THINK_CLOSE]
        return "".join(parts)

    def parser(self, *, thinking: Thinking = "none", tools: bool = False,
               tool_schemas: Sequence[Mapping[str, Any]] | None = None) -> ReplyParser:
        """A fresh parser for one reply rendered with this ``thinking`` setting. ``tool_schemas`` (optional) are
        the tool definitions: parameters they type as strings are never JSON-decoded."""
        tool_parser = ToolCallStreamParser(string_parameters(tool_schemas)) if tools or tool_schemas else None
        return ReplyParser(thinking=thinking, tool_parser=tool_parser, think_close=THINK_CLOSE)
