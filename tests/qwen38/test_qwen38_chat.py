"""Qwen3.8 chat format: ChatML rendering, effort and thinking, XML tool calls rendered and parsed while streaming."""

from __future__ import annotations

import json

import pytest
from ds4_model_qwen38.chat import EFFORT_TEXT, Qwen38Chat

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from ds4_core.errors import TemplateError

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_plain_conversation_without_thinking():
    text = Qwen38Chat().render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_max_thinking_puts_the_xhigh_instruction_first_and_opens_think():
    text = Qwen38Chat().render([{"role": "user", "content": "Hi"}], thinking="max")
    assert text.startswith(f"<|im_start|>system\n{EFFORT_TEXT['xhigh']}<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    medium = Qwen38Chat().render([{"role": "user", "content": "Hi"}], thinking="high")
    assert "Reasoning effort" not in medium and medium.endswith("assistant\n<think>\n")


def test_history_with_reasoning_tool_calls_and_merged_results():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22C"},
    ]
    text = Qwen38Chat().render(messages, tools=TOOLS, thinking="max")
    assert ("<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\nChecking.\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>"
            "<|im_end|>\n") in text
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text.split("<tools>\n")[1].split("\n</tools>")[0]


def test_unknown_role_is_an_error():
    with pytest.raises(TemplateError, match="role"):
        Qwen38Chat().render([{"role": "robot", "content": "x"}])


REPLY = ("Let me look.\n</think>\n\nI will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=now>\n</function>\n</tool_call>")


def _collect(events):
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e.name for e in events if isinstance(e, ToolCallStart)]
    args = {}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            args[e.index] = args.get(e.index, "") + e.text
    ends = {e.index: e.arguments for e in events if isinstance(e, ToolCallEnd)}
    return reasoning, content, starts, args, ends


@pytest.mark.parametrize("piece", [1, 3, len(REPLY)])
def test_streaming_parse_of_reasoning_content_and_calls(piece):
    parser = Qwen38Chat().parser(thinking="max", tools=True)
    events = []
    for i in range(0, len(REPLY), piece):
        events += parser.feed(REPLY[i:i + piece])
    events += parser.finish()
    reasoning, content, starts, args, ends = _collect(events)
    assert reasoning == "Let me look."
    assert content == "I will check."
    assert starts == ["get_weather", "now"]
    assert json.loads(ends[0]) == {"city": "New York", "days": 3} == json.loads(args[0])
    assert json.loads(ends[1]) == {} == json.loads(args[1])
    assert not any(isinstance(e, ContentDelta) and "<" in e.text for e in events)


def test_unfinished_call_becomes_content():
    parser = Qwen38Chat().parser(tools=True)
    events = parser.feed("Sure <tool_call>\n<function=get_weather>\n<parameter=ci") + parser.finish()
    _, content, _, _, ends = _collect(events)
    assert not ends and content.endswith("<parameter=ci") and "Sure" in content


def test_engine_tokenizer_matches_hf_tokenizers_on_a_rendered_chat(tiny_hf, converted):
    from tokenizers import Tokenizer

    from ds4_core.engine import Engine

    text = Qwen38Chat().render([{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                               thinking="max")
    reference = Tokenizer.from_file(str(tiny_hf("a")[0] / "tokenizer.json")).encode(text).ids
    engine = Engine.load(converted("a", "f32"), backend="numpy")
    try:
        assert engine.render([{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                             thinking="max") == reference
    finally:
        engine.close()
