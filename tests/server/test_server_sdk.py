"""The official openai and anthropic SDKs against a real ``ds4 serve`` running the scripted model."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

MODEL = "scripted"  # the --alias conftest starts the server with

TOOL_REPLY = '[[<think>I should look it up.</think>Checking. <tool_call>get_weather\n{"city": "Paris"}</tool_call>]]'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_health_and_models(server, oai):
    health = server.health()
    assert health["status"] == "ok" and health["slots_total"] == 4 and health["slots_busy"] == 0
    (model,) = oai.models.list().data
    assert model.id == MODEL


def test_chat_plain_reply_and_usage(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say [[Bonjour the world]]"}])
    assert r.choices[0].message.content == "Bonjour the world"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_max_tokens_gives_length(oai):
    r = oai.chat.completions.create(model=MODEL, max_tokens=3,
                                    messages=[{"role": "user", "content": "[[a long scripted reply]]"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_stop_string(oai):
    r = oai.chat.completions.create(model=MODEL, stop=["STOP"],
                                    messages=[{"role": "user", "content": "[[before STOP after]]"}])
    assert r.choices[0].message.content == "before "


def test_chat_tool_call_and_reasoning_round_trip(oai):
    messages = [{"role": "user", "content": "weather? " + TOOL_REPLY}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking. "
    assert msg.model_extra["reasoning_content"] == "I should look it up."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [{"role": "assistant", "content": msg.content, "reasoning_content": "I should look it up.",
                  "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                 {"role": "user", "content": "[[It is sunny.]]"}]
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    # The second prompt extends the first turn: the live slot's prefix is reused.
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_accumulates_with_sdk_helper(oai):
    with oai.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "x " + TOOL_REPLY}],
                                     tools=[WEATHER], stream_options={"include_usage": True}) as stream:
        names = [e.name for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert names == ["get_weather"] and call.function.name == "get_weather"  # name sent once, not duplicated
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].message.content == "Checking. "
    assert final.usage is not None and final.usage.completion_tokens > 0


def test_chat_raw_stream_reasoning_deltas_and_done(server):
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": TOOL_REPLY}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should look it up."
    assert "".join(d.get("content", "") or "" for d in deltas) == "Checking. "


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="Repeat: [[raw text]]", max_tokens=50)
    assert r.choices[0].text == "raw text" and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model=MODEL, prompt="[[streamed]]", max_tokens=50, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "streamed"


def test_responses_with_continuation(oai):
    r1 = oai.responses.create(model=MODEL, input="first [[One.]]", instructions="be brief")
    assert r1.output_text == "One." and r1.status == "completed"
    r2 = oai.responses.create(model=MODEL, input="second [[Two.]]", previous_response_id=r1.id)
    assert r2.output_text == "Two."
    assert r2.usage.input_tokens > r1.usage.input_tokens  # the stored conversation was prepended
    assert r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def test_responses_stream_tool_call_and_reasoning(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    with oai.responses.stream(model=MODEL, input="w " + TOOL_REPLY, tools=tools) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
    types = [item.type for item in final.output]
    assert types == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    follow = oai.responses.create(model=MODEL, previous_response_id=final.id, tools=tools, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        {"role": "user", "content": "[[Sunny in Paris.]]"}])
    assert follow.output_text == "Sunny in Paris."


def test_responses_input_tokens(server):
    r = httpx.post(f"{server.url}/v1/responses/input_tokens", json={"model": MODEL, "input": "hello"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_messages_tool_use_and_thinking(claude):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    m = claude.messages.create(model=MODEL, max_tokens=200, tools=tools, system="sys",
                               messages=[{"role": "user", "content": "w " + TOOL_REPLY}])
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "I should look it up." and m.content[1].text == "Checking. "
    assert m.content[2].input == {"city": "Paris"} and m.stop_reason == "tool_use"
    reply = claude.messages.create(model=MODEL, max_tokens=200, tools=tools, system="sys", messages=[
        {"role": "user", "content": "w " + TOOL_REPLY},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[2].id, "content": "sunny"},
                                     {"type": "text", "text": "[[Sunny.]]"}]}])
    assert reply.content[-1].text == "Sunny." and reply.stop_reason == "end_turn"
    assert reply.usage.cache_read_input_tokens > 0


def test_messages_stream_with_sdk_accumulator(claude):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    with claude.messages.stream(model=MODEL, max_tokens=200, tools=tools,
                                messages=[{"role": "user", "content": TOOL_REPLY}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "I should look it up."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens > 0


def test_messages_stop_sequence_and_count_tokens(claude):
    m = claude.messages.create(model=MODEL, max_tokens=100, stop_sequences=["##"],
                               messages=[{"role": "user", "content": "[[left##right]]"}])
    assert m.content[-1].text == "left" and m.stop_reason == "stop_sequence" and m.stop_sequence == "##"
    count = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert count.input_tokens > 0


def test_trace_records_prompts_cache_decisions_and_output(server, gguf, oai):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[traced]]"}])
    events = [json.loads(line) for line in (gguf.parent / "trace.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"prompt", "cache", "generated"} <= kinds
    assert any(e["event"] == "generated" and e["text"] == "traced" for e in events)
