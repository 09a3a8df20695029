"""Qwen3.8 chat format: ChatML with reasoning effort, ``<think>`` and XML tool calls (spec §8).

Thinking levels map to the template's ``reasoning_effort``: ``"none"`` turns thinking off (the generation
prompt closes an empty ``<think>``), ``"high"`` is ``medium`` (no instruction), ``"max"`` is ``xhigh`` (its
instruction opens the system turn). The effort sentences are the template's; the tool instructions are
our own wording of the same format (the checkpoint's exact template bytes were not available, spec §13.3).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_core.chat import Thinking, message_text
from ds4_core.errors import TemplateError

from .xmltools import ToolCallStreamParser, render_tool_call

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

#: The template's reasoning instructions (``medium`` has none).
EFFORT_TEXT = {
    "xhigh": "Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
             "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final "
             "answer.",
    "low": "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion "
           "without unnecessary elaboration.",
}
_EFFORT = {"none": None, "high": "medium", "max": "xhigh"}

_TOOLS_HEADER = "# Tools\n\nThese functions are available, one JSON schema per line:\n\n<tools>\n"
_TOOLS_FOOTER = """
</tools>

To call a function, reply with a block of exactly this form and nothing after it:

<tool_call>
<function=FUNCTION_NAME>
<parameter=PARAMETER_NAME>
VALUE
</parameter>
</function>
</tool_call>

Write string values as plain text and every other value as JSON. Give every required parameter. Any \
explanation goes before the first <tool_call>, never after. Several calls are separate <tool_call> blocks, \
one per line. If no function fits, answer normally."""


def _text(content: Any, where: str) -> str:
    return message_text(content, where, "the Qwen chat format")


def _tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for position, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f'tool {position} is not a function definition; pass {{"type": "function", '
                                '"function": {"name": ..., "parameters": {...}}}')
        lines.append(json.dumps({"type": "function", "function": dict(function)}, ensure_ascii=False))
    return _TOOLS_HEADER + "\n".join(lines) + _TOOLS_FOOTER


def _tool_calls(message: Mapping[str, Any], where: str) -> list[str]:
    calls = []
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f'{where}: tool call {position} needs '
                                '{"function": {"name": ..., "arguments": ...}}')
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise TemplateError(f"{where}: tool call {position} arguments are not JSON: {arguments[:60]!r}") \
                    from None
        if not isinstance(arguments, Mapping):
            raise TemplateError(f"{where}: tool call {position} arguments must be a JSON object")
        calls.append(render_tool_call(function["name"], arguments))
    return calls


class Qwen38Chat:
    """The Qwen3.8 :class:`ds4_core.chat.ChatFormat`."""

    stop_strings: tuple[str, ...] = (IM_END, ENDOFTEXT)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               thinking: Thinking = "none", add_generation_prompt: bool = True) -> str:
        """Prompt text; special tokens appear as their literal strings."""
        if thinking not in _EFFORT:
            raise TemplateError(f"unknown thinking level {thinking!r}; use one of {', '.join(_EFFORT)}")
        effort = _EFFORT[thinking]
        system = [EFFORT_TEXT[effort]] if effort in EFFORT_TEXT else []
        if tools:
            system.append(_tools_block(tools))
        turns: list[str] = []
        pending_results: list[str] = []

        def flush_results() -> None:
            if pending_results:
                body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in pending_results)
                turns.append(f"{IM_START}user{body}{IM_END}\n")
                pending_results.clear()

        for position, message in enumerate(messages):
            where = f"message {position}"
            role = message.get("role") if isinstance(message, Mapping) else None
            content = _text(message.get("content"), where) if isinstance(message, Mapping) else ""
            if role in ("system", "developer"):
                system.append(content)
                continue
            if role == "tool":
                pending_results.append(content)
                continue
            flush_results()
            if role == "user":
                turns.append(f"{IM_START}user\n{content}{IM_END}\n")
            elif role == "assistant":
                reasoning = _text(message.get("reasoning_content"), where).strip("\n")
                calls = _tool_calls(message, where)
                body = content.strip("\n")
                if calls:
                    body = (body + "\n\n" if body else "") + "\n".join(calls)
                turns.append(f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{body}{IM_END}\n")
            else:
                raise TemplateError(f"{where}: unknown role {role!r}; use system, developer, user, assistant or tool")
        flush_results()
        head = f"{IM_START}system\n" + "\n\n".join(system) + f"{IM_END}\n" if system else ""
        prompt = head + "".join(turns)
        if add_generation_prompt:
            prompt += f"{IM_START}assistant\n{THINK_OPEN}\n"
            if effort is None:
                prompt += f"\n{THINK_CLOSE}\n\n"
        return prompt

    def parser(self, *, thinking: Thinking = "none", tools: bool = False) -> ToolCallStreamParser:
        """A fresh parser for one reply rendered with the same ``thinking`` setting."""
        return ToolCallStreamParser(reasoning=_EFFORT.get(thinking) is not None, tools=tools)
