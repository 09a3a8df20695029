"""GLM 5.x chat format: prompts against the published GLM-5.3-Flash goldens (spec §9.2), and the streaming
tool-call parser at every split point."""

from __future__ import annotations

import json

import pytest
from ds4_model_glm5.chat import TOOLS_INTRO, TOOLS_OUTRO, GlmChat

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from ds4_core.errors import TemplateError

CHAT = GlmChat()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"},
                                                "code": {"type": "string"}}}, "strict": True}}


def test_golden_first_turn_with_max_effort():
    messages = [{"role": "system", "content": "Investigate."}, {"role": "user", "content": "Queue id=7"}]
    assert CHAT.render(messages, thinking="max") == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Investigate.<|user|>Queue id=7<|assistant|><think>")


def test_golden_history_with_a_tool_call_and_result():
    messages = [
        {"role": "user", "content": "Fix queue."},
        {"role": "assistant", "content": "", "reasoning_content": "Read source first.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "repo_read", "arguments": json.dumps({"path": "worker.go", "start_line": 1})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "package workload\n"},
    ]
    assert CHAT.render(messages, thinking="high").endswith(
        "<|user|>Fix queue.<|assistant|><think>Read source first.</think><tool_call>repo_read<arg_key>path</arg_key>"
        "<arg_value>worker.go</arg_value><arg_key>start_line</arg_key><arg_value>1</arg_value></tool_call>"
        "<|observation|><tool_response>package workload\n</tool_response><|assistant|><think>")


def test_thinking_off_tools_block_and_grouped_results():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    text = CHAT.render(messages, tools=[WEATHER])
    function = {k: v for k, v in WEATHER["function"].items() if k != "strict"}
    assert text == ("[gMASK]<sop><|system|>" + TOOLS_INTRO + json.dumps(function, ensure_ascii=False) + TOOLS_OUTRO
                    + "<|user|>Hi<|assistant|><think></think>Hello!<|observation|><tool_response>a</tool_response>"
                      "<tool_response>b</tool_response><|assistant|><think></think>")
    assert "Reasoning Effort" not in text


def test_rejects_unknown_roles_and_thinking_levels():
    with pytest.raises(TemplateError, match="unknown role"):
        CHAT.render([{"role": "robot", "content": "x"}])
    with pytest.raises(TemplateError, match="thinking"):
        CHAT.render([], thinking="medium")


def test_special_tokens_encode_as_single_ids(converted):
    from ds4_core.engine import Engine

    engine = Engine.load(converted("default", "f32"), backend="numpy")
    ids = engine.render([{"role": "user", "content": "Hello"}], thinking="high")
    vocab = engine.tokenizer
    assert [vocab.decode([i]) for i in ids[:3]] == ["[gMASK]", "<sop>", "<|system|>"]
    assert [vocab.decode([i]) for i in ids[-2:]] == ["<|assistant|>", "<think>"]


REPLY = ("Let me check.</think>Sure, checking."
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris <b></arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>code</arg_key><arg_value>007</arg_value></tool_call>"
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>")


def _merge(events):
    """Adjacent text deltas joined, so results do not depend on how the text was split."""
    merged = []
    for event in events:
        if merged and type(event) is type(merged[-1]) and isinstance(event, ContentDelta | ReasoningDelta):
            merged[-1] = type(event)(merged[-1].text + event.text)
        elif isinstance(event, ToolCallStart):
            merged.append(ToolCallStart(event.index, "", event.name))
        else:
            merged.append(event)
    return merged


def _parse(text, cut, **kwargs):
    parser = CHAT.parser(**kwargs)
    return _merge(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish())


def test_reply_parses_identically_at_every_split_point():
    first = json.dumps({"city": "Paris <b>", "days": 3, "code": "007"})
    expected = [ReasoningDelta("Let me check."), ContentDelta("Sure, checking."), ToolCallStart(0, "", "get_weather"),
                ToolCallEnd(0, first), ToolCallStart(1, "", "get_weather"),
                ToolCallEnd(1, json.dumps({"city": "Rome"}))]
    for cut in range(len(REPLY) + 1):
        events = _parse(REPLY, cut, thinking="high", tool_schemas=[WEATHER])
        assert [e for e in events if not isinstance(e, ToolCallArgsDelta)] == expected, cut
        deltas = "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta) and e.index == 0)
        assert json.loads(deltas) == json.loads(first)


def test_values_are_json_unless_the_schema_says_string():
    reply = "<tool_call>get_weather<arg_key>code</arg_key><arg_value>007</arg_value></tool_call>"
    untyped = _parse(reply, 5, tools=True)[-1]
    typed = _parse("<tool_call>get_weather<arg_key>days</arg_key><arg_value>07x</arg_value></tool_call>", 9,
                   tools=True, tool_schemas=[WEATHER])[-1]
    assert json.loads(untyped.arguments) == {"code": "007"}  # "007" is not valid JSON, kept as text
    assert json.loads(typed.arguments) == {"days": "07x"}
    assert json.loads(_parse(reply.replace("007", "[1, 2]"), 3, tools=True)[-1].arguments) == {"code": [1, 2]}


def test_malformed_and_truncated_calls_become_content():
    truncated = "Hi<tool_call>get_weather<arg_key>city</arg_key><arg_val"
    assert _parse(truncated, 10, tools=True)[0] == ContentDelta("Hi")
    assert _parse(truncated, 10, tools=True)[-1] == ContentDelta(truncated[2:])
    malformed = "<tool_call>get_weather oops</tool_call> after"
    assert _parse(malformed, 7, tools=True) == [ContentDelta(malformed)]


def test_calls_inside_reasoning_stay_reasoning_and_no_tools_means_content():
    reply = "<tool_call>x</tool_call></think>done"
    assert _parse(reply, 4, thinking="max", tools=True) == [ReasoningDelta("<tool_call>x</tool_call>"),
                                                             ContentDelta("done")]
    assert _parse("<tool_call>x</tool_call>", 3) == [ContentDelta("<tool_call>x</tool_call>")]


def test_render_then_parse_round_trips_tool_calls():
    arguments = {"city": "Zürich", "days": 2, "flags": [True, None], "note": "a <b> & c"}
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]}
    prompt = CHAT.render([message], add_generation_prompt=False)
    reply = prompt.split("</think>", 1)[1]
    events = _parse(reply, len(reply) // 2, tools=True)
    assert events[0] == ToolCallStart(0, "", "get_weather")
    assert json.loads(events[-1].arguments) == arguments


def test_stop_strings_cover_the_eos_set():
    assert {"<|endoftext|>", "<|user|>", "<|observation|>"} <= set(CHAT.stop_strings)


def test_reasoning_left_inline_in_history_is_moved_into_think():
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>why</think>  Answer. "}]
    assert CHAT.render(messages, add_generation_prompt=False).endswith("<|assistant|><think>why</think>Answer.")
