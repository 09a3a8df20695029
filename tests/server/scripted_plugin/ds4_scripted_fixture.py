"""A scripted test model registered through the real ``register_models`` hook.

The model replies with whatever text the prompt asks for: the text between the last ``[[`` and ``]]``
markers (or a fixed greeting when there is none), tokenized with special tokens, then EOS. The reply
starts after the last ``<|assistant|>`` token (chat) or right after ``]]`` (raw completions). Its logits
put all mass on the scripted token, so any sampling setting reproduces the script exactly. A reply may
contain ``<think>…</think>`` and ``<tool_call>NAME\\n{json}</tool_call>``, which :class:`ScriptedChat`
parses into reasoning and tool-call events. ``scripted.token_delay_ms`` slows every forward call down.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.chat import ContentDelta, ReasoningDelta, StreamEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from ds4_core.descriptors import ModelSpec
from ds4_core.hookspecs import hookimpl
from ds4_core.tokenizer import BYTE_TO_CHAR, Tokenizer

DS4_PLUGIN_API = 1
ARCH = "scripted"
CONTROL = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
#: Script delimiters are ordinary BPE tokens: they reach the model from user text, which never yields specials.
SCRIPT = ("[[", "]]")
DEFAULT_REPLY = "Hello from the scripted model."


@hookimpl
def register_models(register: Callable[[ModelSpec], None]) -> None:
    register(ModelSpec(name="scripted", architectures=(ARCH,), loader="ds4_scripted_fixture:load",
                       chat="ds4_scripted_fixture:ScriptedChat", description="scripted replies for server tests"))


def write_scripted_gguf(path: str | Path, *, ctx: int = 1024, delay_ms: int = 0, name: str = "scripted-tiny") -> Path:
    """Write the scripted model's GGUF (tokenizer + one dummy tensor) to ``path``."""
    from ds4_core.testing.gguf_files import write_gguf

    tokens = [*CONTROL, *MARKERS, *BYTE_TO_CHAR, "th", "the", *SCRIPT]
    types = [3] * len(CONTROL) + [4] * len(MARKERS) + [1] * (len(BYTE_TO_CHAR) + 2 + len(SCRIPT))
    metadata = {
        "general.name": name,
        "scripted.context_length": ctx,
        "scripted.token_delay_ms": delay_ms,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["t h", "th e", "[ [", "] ]"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    return write_gguf(path, ARCH, metadata, {"scripted.dummy": np.zeros(8, np.float32)})


class ScriptedState:
    """Token history (int32 ``[ctx]``) and the reply being forced."""

    def __init__(self, ctx: int):
        self.ids = np.zeros(ctx, np.int32)
        self.n = 0
        self.open = -1  # position after the last "[["
        self.anchor = -1  # position where the reply starts
        self.reply = np.zeros(0, np.int32)


class ScriptedModel:
    family = "scripted"

    def __init__(self, tokenizer: Tokenizer, ctx: int, delay_s: float):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.max_context = ctx
        self.delay_s = delay_s
        self.ids = {t: tokenizer.token_id(t) for t in (*CONTROL, *MARKERS, *SCRIPT)}
        self.default_reply = self._reply_ids(DEFAULT_REPLY)

    def _reply_ids(self, text: str) -> np.ndarray:
        return np.asarray([*self.tokenizer.encode(text, special=True), self.tokenizer.eos_id], np.int32)

    def new_state(self, ctx: int) -> ScriptedState:
        return ScriptedState(ctx)

    def state_nbytes(self, ctx: int) -> int:
        return 4 * ctx

    def forward(self, ids: np.ndarray, state: ScriptedState) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        logits = np.full((len(ids), self.vocab_size), -1e4, np.float32)
        for row, token in enumerate(ids.tolist()):
            state.ids[state.n] = token
            state.n += 1
            if token == self.ids["[["]:
                state.open = state.n
            elif token == self.ids["]]"] and state.open >= 0:
                script = self.tokenizer.decode(state.ids[state.open:state.n - 1].tolist())
                state.reply, state.anchor = self._reply_ids(script), state.n
            elif token == self.ids["<|assistant|>"]:
                state.anchor = state.n
                if state.open < 0:
                    state.reply = self.default_reply
            k = state.n - state.anchor
            target = state.reply[k] if state.anchor >= 0 and k < len(state.reply) else self.tokenizer.eos_id
            logits[row, target] = 10.0
        return logits


def load(gguf: Any, weights: Any, ops: Any, options: dict) -> ScriptedModel:
    md = gguf.metadata
    return ScriptedModel(Tokenizer.from_metadata(md), int(md["scripted.context_length"]),
                         int(md["scripted.token_delay_ms"]) / 1000)


class ScriptedChat:
    """``<s><|system|>…<|user|>…<|assistant|>…</s>`` with ``<think>`` and ``<tool_call>`` inside replies."""

    stop_strings: tuple[str, ...] = ()

    def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
               thinking: str = "none", add_generation_prompt: bool = True) -> str:
        out = ["<s>"]
        if tools:
            out.append("<|system|>Tools: " + json.dumps([t["function"]["name"] for t in tools]))
        for m in messages:
            role, content = m["role"], m.get("content") or ""
            if role in ("system", "developer"):
                out.append("<|system|>" + content)
            elif role == "user":
                out.append("<|user|>" + content)
            elif role == "tool":
                out.append("<|tool|>" + content)
            else:
                reasoning = m.get("reasoning_content")
                calls = "".join(f"<tool_call>{c['function']['name']}\n{c['function']['arguments']}</tool_call>"
                                for c in m.get("tool_calls") or ())
                out.append("<|assistant|>" + (f"<think>{reasoning}</think>" if reasoning else "") + content
                           + calls + "</s>")
        if add_generation_prompt:
            out.append("<|assistant|>")
        return "".join(out)

    def parser(self, *, thinking: str = "none", tools: bool = False) -> ScriptedParser:
        return ScriptedParser()


class ScriptedParser:
    """Streams content, ``<think>`` reasoning and ``<tool_call>NAME\\nARGS</tool_call>`` calls."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "content"
        self.started = False
        self.index = 0
        self.args = ""

    def _tags(self) -> tuple[str, ...]:
        if self.mode == "think":
            return ("</think>",)
        if self.mode == "args":
            return ("</tool_call>",)
        return ("<tool_call>",) if self.started else ("<tool_call>", "<think>")

    def _emit(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        self.started = True
        if self.mode == "think":
            return [ReasoningDelta(text)]
        if self.mode == "args":
            self.args += text
            return [ToolCallArgsDelta(self.index, text)]
        return [ContentDelta(text)]

    def feed(self, text: str) -> list[StreamEvent]:
        self.buf += text
        events: list[StreamEvent] = []
        while True:
            if self.mode == "name":
                cut = self.buf.find("\n")
                if cut < 0:
                    return events
                events.append(ToolCallStart(self.index, "call_" + secrets.token_hex(8), self.buf[:cut].strip()))
                self.buf, self.mode, self.args = self.buf[cut + 1:], "args", ""
                continue
            hits = [(i, tag) for tag in self._tags() if (i := self.buf.find(tag)) >= 0]
            if not hits:
                keep = max((n for tag in self._tags() for n in range(1, len(tag)) if self.buf.endswith(tag[:n])),
                           default=0)
                events += self._emit(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return events
            i, tag = min(hits)
            events += self._emit(self.buf[:i])
            self.buf = self.buf[i + len(tag):]
            self.started = True
            if tag == "</tool_call>":
                events.append(ToolCallEnd(self.index, self.args))
                self.index += 1
            self.mode = {"<think>": "think", "</think>": "content", "<tool_call>": "name",
                         "</tool_call>": "content"}[tag]

    def finish(self) -> list[StreamEvent]:
        events = self._emit(self.buf) if self.mode != "name" else [ContentDelta("<tool_call>" + self.buf)]
        if self.mode == "args":
            events.append(ToolCallEnd(self.index, self.args))
        self.buf = ""
        return events
