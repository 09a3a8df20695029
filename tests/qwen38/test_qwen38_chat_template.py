"""A chat template in the Hugging Face directory reaches the GGUF byte for byte through ``ds4 convert``, and the Qwen3.8
renderer's prompt equals that template rendered by transformers' own Jinja machinery on the same conversations.

The template (tests/data/qwen38_chat_template.jinja) is written from spec §8's format description, not copied from
the checkpoint (whose bytes are not available here); its effort sentences and tool instructions use the renderer's
wording, which the spec does not give. Oracles: gguf-py's reader for the file, transformers' ``render_jinja_template``
for the render.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ds4_model_qwen38.chat import Qwen38Chat

from ds4_core.testing.chat_templates import (
    both_renderings,
    convert_cli,
    gguf_template_bytes,
    info_template,
    openai_form,
    render,
    template_in_tokenizer_config,
)

pytest.importorskip("jinja2")
pytest.importorskip("transformers.utils.chat_template_utils")

DATA = Path(__file__).parents[1] / "data"
TEMPLATE = DATA / "qwen38_chat_template.jinja"
CASES = json.loads((DATA / "chat_template_conversations.json").read_text(encoding="utf-8"))
TOOLS: list[dict[str, Any]] = CASES["tools"]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = CASES["conversations"]
#: The renderer's ``thinking`` setting -> the template's variables for the same prompt.
TEMPLATE_THINKING = {"none": {"enable_thinking": False}, "high": {"reasoning_effort": "medium"}, "max": {}}


def render_template(template: str, messages: list[dict[str, Any]], *, tools: list | None, thinking: str,
                    add_generation_prompt: bool = True, **variables: Any) -> str:
    return render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                  **TEMPLATE_THINKING[thinking], **variables)


@pytest.fixture(scope="module")
def gguf_with_template(tiny_hf, tmp_path_factory) -> Path:
    """A Qwen3.8 GGUF converted by ``ds4 convert`` from the tiny model plus ``chat_template.jinja`` (and another
    template in tokenizer_config.json, which the file overrides as in transformers)."""
    src = tmp_path_factory.mktemp("qwen38-template") / "src"
    shutil.copytree(tiny_hf("a")[0], src)
    shutil.copyfile(TEMPLATE, src / "chat_template.jinja")
    template_in_tokenizer_config(src, "{% for m in messages %}{{ m.content }}{% endfor %}")
    convert_cli(src, src.parent / "out.gguf")
    return src.parent / "out.gguf"


@pytest.fixture(scope="module")
def template(gguf_with_template: Path) -> str:
    """The chat template as read back from the GGUF."""
    return gguf_template_bytes(gguf_with_template).decode("utf-8")






def test_chat_template_jinja_reaches_the_gguf_byte_for_byte(gguf_with_template):
    assert gguf_template_bytes(gguf_with_template) == TEMPLATE.read_bytes()


def test_chat_template_in_tokenizer_config_reaches_the_gguf(tiny_hf, tmp_path):
    shutil.copytree(tiny_hf("a")[0], tmp_path / "src")
    template_in_tokenizer_config(tmp_path / "src", TEMPLATE.read_text(encoding="utf-8"))
    convert_cli(tmp_path / "src", tmp_path / "out.gguf")
    assert gguf_template_bytes(tmp_path / "out.gguf") == TEMPLATE.read_bytes()


def test_ds4_info_reports_the_template(gguf_with_template):
    assert info_template(gguf_with_template) == TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize("thinking", ["none", "high", "max"])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_the_gguf_template(template, name, with_tools, thinking):
    ours, theirs = both_renderings(Qwen38Chat(), template, CONVERSATIONS[name], tools=TOOLS if with_tools else None,
                                   thinking=thinking, template_variables=TEMPLATE_THINKING[thinking])
    assert ours == theirs


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_the_template_without_generation_prompt(template, name):
    ours, theirs = both_renderings(Qwen38Chat(), template, CONVERSATIONS[name], tools=TOOLS, thinking="max",
                                   template_variables=TEMPLATE_THINKING["max"], add_generation_prompt=False)
    assert ours == theirs


def test_spec_layout(template):
    """Spec §8's layout written out by hand: ChatML turns, ``<think>`` wrappers kept when empty, a blank line
    before calls that follow text, tool results merged into one user turn, both generation prompts."""
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
                {"role": "tool", "content": "snow"}, {"role": "tool", "content": "cold"}]
    body = ("<|im_start|>user\nOslo?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsnow\n"
            "</tool_response>\n<tool_response>\ncold\n</tool_response><|im_end|>\n")
    for thinking, prompt in (("none", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                             ("high", "<|im_start|>assistant\n<think>\n")):
        assert Qwen38Chat().render(openai_form(messages), thinking=thinking) == body + prompt
        assert render_template(template, messages, tools=None, thinking=thinking) == body + prompt


def test_template_options_the_renderer_does_not_offer(template):
    """The template's ``reasoning_effort="low"`` and ``preserve_thinking=False`` (spec §8), against its defaults."""
    messages = CONVERSATIONS["multi_turn_reasoning"][:-1]  # ends with an assistant turn after the last user turn
    kept = render_template(template, messages, tools=None, thinking="high")
    dropped = render_template(template, messages, tools=None, thinking="high", preserve_thinking=False)
    assert dropped == kept.replace("<think>\nTwo plus two is four.\n</think>", "<think>\n\n</think>")
    assert "<think>\nSix.\n</think>\n\n6<|im_end|>" in dropped
    low = render_template(template, messages, tools=None, thinking="max", reasoning_effort="low")
    assert low.startswith("<|im_start|>system\nReasoning effort is set to low. ")
    assert low.endswith(kept.removeprefix("<|im_start|>system\n"))
