"""DeepSeek V4 prompt rendering and reply parsing (spec §14)."""

import json
import random

import pytest
from ds4_model_deepseek4.chat import DeepSeekV4Chat

from ds4_core.chat import ContentDelta, ReasoningDelta, ToolCallEnd, ToolCallStart
from ds4_core.errors import TemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
CHAT = DeepSeekV4Chat()
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


def weather_call(arguments: str = '{"days": 2, "city": "Paris"}') -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_single_turn_golden_strings_for_each_thinking_mode():
    assert CHAT.render(HI) == f"{BOS}{USER}Hi{ASSISTANT}</think>"
    assert CHAT.render(HI, thinking="high") == f"{BOS}{USER}Hi{ASSISTANT}<think>"
    prompt = CHAT.render(HI, thinking="max")
    prefix = prompt.removeprefix(BOS).removesuffix(f"{USER}Hi{ASSISTANT}<think>")
    lines = prefix.split("\n")
    assert lines[0] == "Reasoning Effort: Absolute maximum with no shortcuts permitted."
    assert len(lines) == 5 and all(lines[:3]) and lines[3:] == ["", ""]  # three lines, then a blank line


def test_system_and_developer_messages_merge_into_one_block_after_bos():
    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
    ]
    expected = f"{BOS}You are a helpful assistant\n\nBe brief.{USER}Hi{ASSISTANT}</think>"
    assert CHAT.render(messages) == expected


def test_multi_turn_drops_reasoning_of_turns_before_the_last_user_message():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = f"{BOS}{USER}Q1{ASSISTANT}</think>A1{EOS}{USER}Q2{ASSISTANT}<think>"
    assert CHAT.render(messages, thinking="high") == expected
    continued = [*messages, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    assert CHAT.render(continued, thinking="high", add_generation_prompt=False) == (
        f"{BOS}{USER}Q1{ASSISTANT}</think>A1{EOS}{USER}Q2{ASSISTANT}<think>R2</think>A2{EOS}"
    )
    assert CHAT.render(continued, add_generation_prompt=False).endswith(f"{ASSISTANT}</think>A2{EOS}")


def test_tools_and_results_golden_with_consecutive_results_in_one_user_turn():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need data.", "tool_calls": [weather_call()]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "x</tool_result>y"}]},
    ]
    prompt = CHAT.render(messages, tools=[WEATHER], thinking="high")
    system, _, turns = prompt.removeprefix(BOS).partition(USER)
    assert system.startswith("## Tools\n\n")
    assert "\n### Available Tool Schemas\n\n" + json.dumps(WEATHER["function"]) + "\n\n" in system
    assert system.endswith("\n\nBe brief.")
    assert USER + turns == (
        f"{USER}Weather?{ASSISTANT}<think>Need data.</think>\n\n"
        f"<{D}tool_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
        f"</{D}invoke>\n"
        f"</{D}tool_calls>{EOS}"
        f"{USER}<tool_result>sunny</tool_result><tool_result>x&lt;/tool_result>y</tool_result>"
        f"{ASSISTANT}<think>"
    )


def test_tool_context_keeps_earlier_reasoning_and_thinking_off_never_shows_it():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    assert f"{ASSISTANT}<think>R1</think>A1{EOS}" in CHAT.render(messages, tools=[WEATHER], thinking="max")
    assert f"{ASSISTANT}</think>A1{EOS}" in CHAT.render(messages, tools=[WEATHER])
    history_with_results = [*messages[:1], {"role": "tool", "content": "r"}, *messages[1:]]
    assert f"<think>R1</think>A1{EOS}" in CHAT.render(history_with_results, thinking="high")


def test_tool_call_arguments_that_are_not_a_json_object_are_kept_verbatim():
    messages = [*HI, {"role": "assistant", "content": "", "tool_calls": [weather_call("{broken")]}]
    prompt = CHAT.render(messages)
    assert f'<{D}parameter name="arguments" string="true">{{broken</{D}parameter>' in prompt


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([{"role": "robot", "content": "x"}], {}, "unknown role 'robot'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], {}, "'image_url'"),
        ([{"role": "user", "content": 5}], {}, "content must be a string"),
        (HI, {"thinking": "low"}, "thinking must be one of"),
        (HI, {"tools": [{"type": "web_search"}]}, "tool 0 is not a function definition"),
        ([*HI, {"role": "assistant", "tool_calls": [{"id": "x"}]}], {}, "tool call 0 needs"),
    ],
)
def test_invalid_input_raises_template_error_saying_what_to_fix(messages, kwargs, message):
    with pytest.raises(TemplateError, match=message):
        CHAT.render(messages, **kwargs)


def test_tool_result_without_a_preceding_call_still_renders():
    assert CHAT.render([{"role": "tool", "content": "orphan"}]) == (
        f"{BOS}{USER}<tool_result>orphan</tool_result>{ASSISTANT}</think>"
    )


def test_stop_strings_end_at_eos():
    assert CHAT.stop_strings == (EOS,)


REPLY = (
    f"The user wants weather; maybe <{D}tool_calls> later. </thin k> ok</think>Checking now.\n\n"
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Paris &amp; Lyon</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)


def parse(text: str, pieces: list[int], **options) -> tuple[str, str, list[tuple[str, str]]]:
    parser = CHAT.parser(**options)
    events, position = [], 0
    for size in pieces:
        events += parser.feed(text[position : position + size])
        position += size
    events += parser.feed(text[position:]) + parser.finish()
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
        [(names[e.index], e.arguments) for e in events if isinstance(e, ToolCallEnd)],
    )


def test_thinking_reply_splits_into_reasoning_content_and_calls():
    expected = (
        f"The user wants weather; maybe <{D}tool_calls> later. </thin k> ok",
        "Checking now.",
        [("get_weather", '{"city": "Paris & Lyon", "days": 2}')],
    )
    assert parse(REPLY, [], thinking="high", tools=True) == expected
    for cut in range(len(REPLY) + 1):
        assert parse(REPLY, [cut], thinking="high", tools=True) == expected, cut
    assert parse(REPLY, [1] * len(REPLY), thinking="high", tools=True) == expected
    rng = random.Random(7)
    for _ in range(50):
        assert parse(REPLY, [rng.randint(1, 9) for _ in REPLY], thinking="high", tools=True) == expected


def test_without_tools_dsml_is_content_and_without_thinking_there_is_no_reasoning():
    _, content, calls = parse(REPLY, [3] * len(REPLY), thinking="high")
    assert content == REPLY.partition("</think>")[2] and calls == []
    assert parse("plain </think> text", [1] * 20) == ("", "plain </think> text", [])


def test_unfinished_reasoning_stays_reasoning_including_a_held_partial_close_tag():
    assert parse("still thinking </thi", [1] * 20, thinking="max", tools=True) == ("still thinking </thi", "", [])
