"""T10 numeric bounds and malformed-but-schema-valid bodies: always a native 4xx, never a 5xx (in-process ASGI)."""

from __future__ import annotations

import json

import pytest
from conftest import MODEL, in_process_app
from starlette.testclient import TestClient

USER = [{"role": "user", "content": "hi"}]
#: One valid request per API and the numeric fields it takes.
APIS = {
    "/v1/chat/completions": ({"model": MODEL, "messages": USER},
                             ("n", "max_tokens", "max_completion_tokens", "top_logprobs", "top_k", "seed",
                              "temperature", "top_p", "min_p")),
    "/v1/completions": ({"model": MODEL, "prompt": "hi"},
                        ("n", "max_tokens", "logprobs", "top_k", "seed", "temperature", "top_p", "min_p")),
    "/v1/responses": ({"model": MODEL, "input": "hi"},
                      ("max_output_tokens", "top_logprobs", "top_k", "seed", "temperature", "top_p", "min_p")),
    "/v1/messages": ({"model": MODEL, "max_tokens": 8, "messages": USER},
                     ("max_tokens", "top_k", "seed", "temperature", "top_p", "min_p")),
}
#: Raw JSON texts: negatives (seed allows -1 = random, so -2), 2**63 (past int64), NaN, ±inf, strings, booleans.
BAD = ("-2", "-1e300", str(2**63), "1e400", "NaN", "Infinity", "-Infinity", '"1"', '"nan"', "true", "[1]", "{}")
CASES = [(path, field, raw) for path, (_, fields) in APIS.items() for field in fields for raw in BAD]


@pytest.fixture(scope="module")
def client(gguf) -> TestClient:
    with TestClient(in_process_app(gguf), raise_server_exceptions=False) as c:
        yield c


def native_error(path: str, r) -> str:
    """The error message, after checking the body has the API's own error shape."""
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == r.status_code, body
    return body["error"]["message"]


def post_raw(client: TestClient, path: str, body: dict, field: str, raw: str):
    text = json.dumps(body)[:-1] + f', "{field}": {raw}}}'
    return client.post(path, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, field, raw", CASES, ids=[f"{p.rsplit('/', 1)[1]}-{f}-{r}" for p, f, r in CASES])
def test_out_of_range_numbers_are_native_400(client, path, field, raw):
    if raw == "-2" and field in ("top_k", "top_logprobs", "logprobs"):
        raw = "-1"  # 0 is valid for these, so -1 is the negative to try
    r = post_raw(client, path, APIS[path][0], field, raw)
    assert r.status_code == 400, r.text
    assert field in native_error(path, r)


@pytest.mark.parametrize("path", APIS)
def test_edges_inside_the_bounds_are_accepted(client, path):
    body, fields = APIS[path]
    edges = {"max_tokens": 2**63 - 1, "max_completion_tokens": 1, "max_output_tokens": 2**63 - 1, "top_k": 0,
             "seed": -1, "temperature": 0, "top_p": 1, "min_p": 0, "n": 1, "top_logprobs": 20, "logprobs": 5}
    r = client.post(path, json={**body, **{f: edges[f] for f in fields}})
    assert r.status_code == 200, r.text
    r = client.post(path, json={**body, "seed": 2**63 - 1, "top_k": 2**63 - 1, "temperature": 100})
    assert r.status_code == 200, r.text


def test_n_and_top_logprobs_caps(client):
    for extra in ({"n": 2}, {"top_logprobs": 21}):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra})
        assert r.status_code == 400 and next(iter(extra)) in native_error("/v1/chat/completions", r)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_output_never_exceeds_context_minus_prompt(client, path):
    ctx = 1024  # the scripted GGUF's context
    long_reply = "[[" + "the " * 400 + "]]"  # ~800 prompt tokens and an ~800-token script
    body = {"model": MODEL, **({"input": long_reply} if path == "/v1/responses" else
                               {"messages": [{"role": "user", "content": long_reply}]}),
            **({"max_tokens": 2**63 - 1} if path != "/v1/responses" else {"max_output_tokens": 2**63 - 1})}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    prompt = usage.get("prompt_tokens") or usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    assert prompt + completion <= ctx and completion == ctx - prompt  # stopped by the context, not the script
    assert "length" in r.text or "max_tokens" in r.text or "incomplete" in r.text


#: Bodies the schema allows (free-form dicts) that once raised AttributeError / TypeError → 500.
MALFORMED = [
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"function": "f"}}),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"function": 3}}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": ["not a block"]}]}]}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": 5}]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "a", "output": {"a": 1}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc80 lone surrogate"}]}),
    ("/v1/responses", {"input": "x", "instructions": "ok", "previous_response_id": "\ud800"}),
    ("/v1/chat/completions", {"messages": USER, "seed": True}),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}),
]


@pytest.mark.parametrize("path, body", MALFORMED)
def test_malformed_bodies_are_native_400(client, path, body):
    r = client.post(path, content=json.dumps({"model": MODEL, **body}), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    native_error(path, r)


def test_reasoning_item_with_string_content_is_tolerated(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": [
        {"type": "reasoning", "content": "thought"}, {"role": "user", "content": "[[ok]]"}]})
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == "ok"


@pytest.mark.parametrize("method, path, status", [("GET", "/nope", 404), ("DELETE", "/v1/chat/completions", 405),
                                                  ("GET", "/v1/messages/nope", 404)])
def test_unknown_routes_and_methods_answer_in_native_shape(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status
    body = r.json()
    assert body["type"] == "error" if path.startswith("/v1/messages") else body["error"]["code"] == status


def test_deeply_nested_json_is_a_400(client):
    deep = '{"model": "scripted", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400
    native_error("/v1/chat/completions", r)
