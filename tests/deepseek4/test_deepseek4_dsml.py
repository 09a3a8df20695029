"""DSML tool-call rendering and parsing (spec §14), including streaming in arbitrary pieces."""

import json
import random

import pytest
from ds4_model_deepseek4.dsml import ToolCallStreamParser, parse_tool_calls, render_tool_calls

from ds4_core.chat import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

D = "｜DSML｜"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


def block(*invokes: str, style: str = D) -> str:
    return f"<{style}tool_calls>\n" + "".join(invokes) + f"</{style}tool_calls>"


def invoke(name: str, *params: str, style: str = D) -> str:
    return f'<{style}invoke name="{name}">\n' + "".join(params) + f"</{style}invoke>\n"


def param(name: str, value: str, string: str | None = "true", style: str = D) -> str:
    kind = "" if string is None else f' string="{string}"'
    return f'<{style}parameter name="{name}"{kind}>{value}</{style}parameter>\n'


def stream(text: str, pieces: list[int] | None = None) -> list:
    """Feed ``text`` cut at the given lengths (1-char pieces by default), then finish."""
    parser = ToolCallStreamParser()
    events, position = [], 0
    for size in pieces or [1] * len(text):
        events += parser.feed(text[position : position + size])
        position += size
    return events + parser.feed(text[position:]) + parser.finish()


def summary(events: list) -> tuple[str, list[tuple[int, str, str]], dict[int, str]]:
    """(content, [(index, name, final arguments)], {index: concatenated argument deltas})."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    ended = [(e.index, names[e.index], e.arguments) for e in events if isinstance(e, ToolCallEnd)]
    deltas: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            deltas[e.index] = deltas.get(e.index, "") + e.text
    return content, ended, deltas


def test_render_golden_block_follows_schema_property_order():
    text = render_tool_calls([{"name": "get_weather", "arguments": {"days": 3, "city": "Paris"}}], [WEATHER])
    assert text == (
        f"\n\n<{D}tool_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f"</{D}invoke>\n"
        f"</{D}tool_calls>"
    )


def test_render_without_schema_keeps_argument_order_and_renders_nothing_for_no_calls():
    text = render_tool_calls([{"name": "f", "arguments": {"b": True, "a": None}}])
    assert text.index('name="b" string="false">true<') < text.index('name="a" string="false">null<')
    assert render_tool_calls([]) == ""


def test_render_escapes_attributes_and_only_the_closing_tag_in_strings():
    text = render_tool_calls([{"name": 'a"<b>&', "arguments": {"cmd": f"echo 2>&1 && echo </{D}parameter> <x>"}}])
    assert 'invoke name="a&quot;&lt;b&gt;&amp;"' in text
    assert f">echo 2>&1 && echo &lt;/{D}parameter> <x></{D}parameter>" in text


def test_render_json_value_spells_closing_tag_as_unicode_escape():
    text = render_tool_calls([{"name": "f", "arguments": {"v": ["x", f"</{D}parameter>"]}}])
    assert f'string="false">["x", "\\u003c/{D}parameter>"]</{D}parameter>' in text


@pytest.mark.parametrize(
    "arguments",
    [
        {"s": f"before </{D}parameter> after"},
        {"s": 'He said "hi" & left; a && b 2>&1 <tag attr="v">'},
        {"s": "&amp; &lt; &gt; &quot; &apos; &copy; &"},
        {"s": "日本語のテキスト 😀 ünïcödé"},
        {"s": "", "t": "  padded\n\n", "u": f"&lt;/{D}parameter>"},
        {"n": 3, "x": 2.5, "b": False, "z": None, "l": [1, "two", {"k": f"</{D}parameter>"}], "o": {"a": {"b": []}}},
    ],
)
def test_render_then_parse_gives_back_the_calls(arguments):
    calls = [{"name": "tool", "arguments": arguments}, {"name": "other", "arguments": {}}]
    visible, parsed = parse_tool_calls("Let me look." + render_tool_calls(calls))
    assert visible == "Let me look."
    assert parsed == calls


def test_parse_accepts_the_variant_missing_the_first_bar_and_plain_tags():
    for style in ("DSML｜", ""):
        text = "ok\n" + block(invoke("f", param("a", "1", "false", style), style=style), style=style)
        assert parse_tool_calls(text) == ("ok", [{"name": "f", "arguments": {"a": 1}}])


def test_parse_decodes_entities_in_strings_but_not_in_json():
    text = block(invoke("f", param("s", "&lt;b&gt; &amp;&amp; &quot;&apos; &nbsp;"), param("j", '"&amp;"', "false")))
    assert parse_tool_calls(text)[1] == [{"name": "f", "arguments": {"s": "<b> && \"' &nbsp;", "j": "&amp;"}}]


def test_parse_missing_string_attribute_means_string_and_invalid_json_becomes_string():
    text = block(invoke("f", param("s", " 42 ", None), param("j", "not json", "false")))
    assert parse_tool_calls(text)[1] == [{"name": "f", "arguments": {"s": " 42 ", "j": "not json"}}]


def test_parse_nested_parameters_become_a_json_object():
    nested = "\n" + param("x", "1", "false") + param("y", "a&amp;b") + param("z", "t", None)
    text = block(invoke("f", param("opts", nested, None), param("after", "v")))
    expected = {"opts": {"x": 1, "y": "a&b", "z": "t"}, "after": "v"}
    assert parse_tool_calls(text)[1] == [{"name": "f", "arguments": expected}]


def test_text_after_a_block_stays_visible_but_trailing_whitespace_does_not():
    call = block(invoke("f"))
    assert parse_tool_calls(f"A \n\n{call}\n\nB") == ("A\n\nB", [{"name": "f", "arguments": {}}])
    assert parse_tool_calls(f"A\n\n{call}\n \n") == ("A", [{"name": "f", "arguments": {}}])
    assert parse_tool_calls("no block here  \n") == ("no block here  \n", [])


def test_malformed_block_is_returned_verbatim_as_content():
    for text in (
        "Hi\n\n" + block(f"<{D}bogus>\n"),
        "Hi\n\n" + block(f"<{D}invoke>\n</{D}invoke>\n"),  # no name
        "Hi\n\n" + block(invoke("f", f'<{D}parameter string="true">v</{D}parameter>\n')),  # no name
        f'Hi <{D}tool_calls><{D}invoke name="f"><{D}parameter name="a">unterminated',
        f'Hi <{D}tool_calls><{D}invoke name="f"',
        'Hi <DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n',  # styles do not mix
    ):
        assert parse_tool_calls(text) == (text, []), text


def test_calls_completed_before_a_malformed_invoke_are_kept():
    good = invoke("first", param("a", "1", "false"))
    bad = f'<{D}invoke name="second">\n<{D}oops>'
    visible, calls = parse_tool_calls("Hi\n\n" + f"<{D}tool_calls>\n" + good + bad)
    assert calls == [{"name": "first", "arguments": {"a": 1}}]
    assert visible == "Hi\n" + bad  # the newline after the good invoke starts the unparsed rest


def test_reply_ending_after_a_complete_invoke_keeps_the_call():
    text = f"<{D}tool_calls>\n" + invoke("f", param("a", "x")) + "\n"
    assert parse_tool_calls(text) == ("", [{"name": "f", "arguments": {"a": "x"}}])


def test_truncated_call_streams_a_start_without_end_and_its_text_as_content():
    text = f'Hi\n\n<{D}tool_calls>\n<{D}invoke name="write">\n<{D}parameter name="body" string="true">partial'
    events = stream(text)
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["write"]
    assert not [e for e in events if isinstance(e, ToolCallEnd)]
    assert summary(events)[0] == text


SAMPLE = (
    "I'll check both cities. <b>bold</b> & <tool_calls_not> here.\n\n"
    + block(
        invoke("get_weather", param("city", "São Paulo &amp; <Rio>"), param("days", "3", "false")),
        invoke(
            "run",
            param("cmd", f"cat a.txt 2>&1 | grep '&lt;/{D}parameter>' && echo \"done\"\n"),
            param("env", '{"A": "1", "B": [true, null]}', "false"),
            param("opts", "\n" + param("verbose", "true", "false") + param("name", "x"), None),
        ),
    )
    + "\n"
)


def test_sample_reply_parses_to_the_expected_calls():
    visible, calls = parse_tool_calls(SAMPLE)
    assert visible == "I'll check both cities. <b>bold</b> & <tool_calls_not> here."
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "São Paulo & <Rio>", "days": 3}},
        {
            "name": "run",
            "arguments": {
                "cmd": f"cat a.txt 2>&1 | grep '</{D}parameter>' && echo \"done\"\n",
                "env": {"A": "1", "B": [True, None]},
                "opts": {"verbose": True, "name": "x"},
            },
        },
    ]


def test_streaming_at_every_split_point_matches_one_shot():
    reference = summary(stream(SAMPLE, [len(SAMPLE)]))
    assert reference[0] == parse_tool_calls(SAMPLE)[0]
    for cut in range(len(SAMPLE) + 1):
        assert summary(stream(SAMPLE, [cut])) == reference, cut
    assert summary(stream(SAMPLE)) == reference


def test_streaming_in_random_pieces_matches_one_shot_and_deltas_build_the_arguments():
    reference = summary(stream(SAMPLE, [len(SAMPLE)]))
    rng = random.Random(4)
    for _ in range(100):
        content, ended, deltas = summary(stream(SAMPLE, [rng.randint(1, 12) for _ in range(len(SAMPLE))]))
        assert (content, ended) == reference[:2]
        assert deltas == {index: arguments for index, _, arguments in ended}
        assert [json.loads(arguments) for _, _, arguments in ended] == [
            c["arguments"] for c in parse_tool_calls(SAMPLE)[1]
        ]


def test_content_that_may_start_a_tag_is_held_until_disambiguated():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello\n\n<｜DS") == [ContentDelta("Hello")]
    assert parser.feed("ML｜tool_c") == []
    assert parser.feed("ool!") == [ContentDelta(f"\n\n<{D}tool_cool!")]


def test_string_values_stream_before_the_parameter_closes():
    parser = ToolCallStreamParser()
    events = parser.feed(
        f'<{D}tool_calls>\n<{D}invoke name="w">\n<{D}parameter name="body" string="true">line one\n&am'
    )
    assert isinstance(events[0], ToolCallStart) and events[0].index == 0 and events[0].id.startswith("call_0_")
    assert "".join(e.text for e in events[1:]) == '{"body": "line one\\n'
    assert parser.feed("p;") == [ToolCallArgsDelta(0, "&")]
