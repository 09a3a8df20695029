"""A chat template in the Hugging Face directory reaches the GGUF byte for byte through ``ds4 convert``, and the GLM
renderer's prompt equals that template rendered by transformers' own Jinja machinery on the same conversations.

The template (tests/data/glm5_chat_template.jinja) is written from spec §9.2's format description, not copied from
the checkpoint; spec §9.2's GLM-5.3-Flash goldens pin both. Oracles: gguf-py's reader for the file, transformers'
``render_jinja_template`` for the render.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from ds4_model_glm5.chat import GlmChat

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
TEMPLATE = DATA / "glm5_chat_template.jinja"
CASES = json.loads((DATA / "chat_template_conversations.json").read_text(encoding="utf-8"))
TOOLS: list[dict[str, Any]] = CASES["tools"]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    **CASES["conversations"],
    # GLM only: reasoning left inline in the content, GLM-4.7-style "</think>answer", and "function" results
    "inline_reasoning": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>Greet back.</think>\nHello!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "</think>Hello again."},
        {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "run_sql", "arguments": {"query": "SELECT 2"}}}]},
        {"role": "function", "content": "2"},
    ],
}
#: The renderer's ``thinking`` setting -> the template's variables for the same prompt.
TEMPLATE_THINKING = {"none": {"enable_thinking": False}, "high": {"reasoning_effort": "High"}, "max": {}}


def render_template(template: str, messages: list[dict[str, Any]], *, tools: list | None, thinking: str,
                    add_generation_prompt: bool = True, **variables: Any) -> str:
    return render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                  **TEMPLATE_THINKING[thinking], **variables)


@pytest.fixture(scope="module")
def gguf_with_template(tiny_hf, tmp_path_factory) -> Path:
    """A GLM 5.2 GGUF converted by ``ds4 convert`` from the tiny model plus ``chat_template.jinja``."""
    work = tmp_path_factory.mktemp("glm52-template")
    shutil.copytree(tiny_hf("default")[0], work / "src")
    shutil.copyfile(TEMPLATE, work / "src" / "chat_template.jinja")
    convert_cli(work / "src", work / "out.gguf")
    return work / "out.gguf"


@pytest.fixture(scope="module")
def template(gguf_with_template: Path) -> str:
    """The chat template as read back from the GGUF."""
    return gguf_template_bytes(gguf_with_template).decode("utf-8")


def test_chat_template_jinja_reaches_the_gguf_byte_for_byte(gguf_with_template):
    assert gguf_template_bytes(gguf_with_template) == TEMPLATE.read_bytes()


def test_chat_template_in_tokenizer_config_reaches_the_glm5_next_gguf(tiny_next_hf, tmp_path):
    shutil.copytree(tiny_next_hf("mixed")[0], tmp_path / "src")
    template_in_tokenizer_config(tmp_path / "src", TEMPLATE.read_text(encoding="utf-8"))
    convert_cli(tmp_path / "src", tmp_path / "out.gguf")
    assert gguf_template_bytes(tmp_path / "out.gguf") == TEMPLATE.read_bytes()


def test_without_a_template_the_gguf_has_none(tiny_hf, tmp_path):
    convert_cli(tiny_hf("default")[0], tmp_path / "out.gguf")
    assert gguf_template_bytes(tmp_path / "out.gguf") is None


def test_ds4_info_reports_the_template(gguf_with_template):
    assert info_template(gguf_with_template) == TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize("thinking", ["none", "high", "max"])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_the_gguf_template(template, name, with_tools, thinking):
    ours, theirs = both_renderings(GlmChat(), template, CONVERSATIONS[name], tools=TOOLS if with_tools else None,
                                   thinking=thinking, template_variables=TEMPLATE_THINKING[thinking])
    assert ours == theirs


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renderer_equals_the_template_without_generation_prompt(template, name):
    ours, theirs = both_renderings(GlmChat(), template, CONVERSATIONS[name], tools=TOOLS, thinking="max",
                                   template_variables=TEMPLATE_THINKING["max"], add_generation_prompt=False)
    assert ours == theirs


def test_spec_goldens(template):
    """Spec §9.2's GLM-5.3-Flash examples, from a public port: both renderings give them."""
    first = [{"role": "system", "content": "Investigate."}, {"role": "user", "content": "Queue id=7"}]
    golden = "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Investigate.<|user|>Queue id=7<|assistant|><think>"
    assert GlmChat().render(first, thinking="max") == golden
    assert render_template(template, first, tools=None, thinking="max") == golden

    history = [{"role": "user", "content": "Fix queue."},
               {"role": "assistant", "content": "", "reasoning_content": "Read source first.", "tool_calls": [
                   {"function": {"name": "repo_read", "arguments": {"path": "worker.go", "start_line": 1}}}]},
               {"role": "tool", "content": "package workload\n"}]
    tail = ("<|user|>Fix queue.<|assistant|><think>Read source first.</think><tool_call>repo_read<arg_key>path"
            "</arg_key><arg_value>worker.go</arg_value><arg_key>start_line</arg_key><arg_value>1</arg_value>"
            "</tool_call><|observation|><tool_response>package workload\n</tool_response><|assistant|><think>")
    assert GlmChat().render(openai_form(history), thinking="max").endswith(tail)
    assert render_template(template, history, tools=None, thinking="max").endswith(tail)


def test_template_clear_thinking_drops_only_reasoning_before_the_last_user_turn(template):
    """The template's ``clear_thinking`` (spec §9.2; the renderer always preserves thinking, its default)."""
    messages = CONVERSATIONS["multi_turn_reasoning"][:-1]  # ends with an assistant turn after the last user turn
    kept = render_template(template, messages, tools=None, thinking="max")
    cleared = render_template(template, messages, tools=None, thinking="max", clear_thinking=True)
    assert kept == render_template(template, messages, tools=None, thinking="max", clear_thinking=False)
    assert cleared == kept.replace("<think>Two plus two is four.</think>", "<think></think>")
    assert "<think>\nSix.\n</think>" in cleared
