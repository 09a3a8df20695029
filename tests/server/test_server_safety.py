"""Errors in native shapes, auth, CORS, body limit, queueing, disconnects, concurrency and the disk KV cache."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import run_server

MODEL = "scripted"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
          ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
          ("POST", "/v1/responses", {"model": MODEL, "input": "x"}),
          ("POST", "/v1/responses/input_tokens", {"model": MODEL, "input": "x"}),
          ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
          ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})]


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (json.dumps({**CHAT, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({**CHAT, "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({**CHAT, "max_tokens": 2**70}).encode(), "max_tokens"),
    (json.dumps({**CHAT, "top_p": 7}).encode(), "top_p"),
    (b'{"model": "scripted", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), "image_url"),
])
def test_bad_chat_requests_are_native_400(server, body, needle):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = _openai_error(r, 400)
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_and_context_overflow(server):
    err = _openai_error(httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert "gpt-9" in err["message"]
    long = {**CHAT, "messages": [{"role": "user", "content": "z " * 3000}]}
    err = _openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=long), 400)
    assert "context" in err["message"]


def test_anthropic_errors_use_anthropic_shape(server):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]


def test_body_over_64_mib_is_413(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b" " * (64 * 2**20 + 1),
                   headers={"content-type": "application/json"}, timeout=60)
    assert _openai_error(r, 413)["message"].startswith("request body over")


def test_auth_matrix_and_cors(gguf):
    with run_server(gguf, "--api-key", "s3cret", "--cors", "https://a.example") as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # public
        for method, path, body in ROUTES:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = httpx.request(method, srv.url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                shape = r.json()
                assert ("type" in shape and shape["type"] == "error") if "/messages" in path else "error" in shape
            for headers in ({"authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
                assert httpx.request(method, srv.url + path, json=body, headers=headers, timeout=30).status_code == 200
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[ok]]"}]) \
            .choices[0].message.content == "ok"
        pre = httpx.options(f"{srv.url}/v1/chat/completions", headers={
            "origin": "https://a.example", "access-control-request-method": "POST"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://a.example"
        assert "POST" in pre.headers["access-control-allow-methods"] and not pre.content
        evil = httpx.options(f"{srv.url}/v1/chat/completions", headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in evil.headers


def test_cors_closed_by_default(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_concurrent_streams_complete_and_free_every_slot(server):
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"[[reply {i}]]"}]}
        text = ""
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        return text

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == [f"reply {i}" for i in range(32)]
    assert server.health()["slots_busy"] == 0 and server.health()["queued"] == 0


def test_queue_limit_503_and_disconnect_frees_slot(slow_gguf):
    with run_server(slow_gguf, "--queue-limit", "1") as srv:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "[[" + "a " * 200 + "]]"}]}

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as first:
                    lines = first.aiter_lines()  # kept referenced: dropping it would close the stream
                    await anext(lines)
                    queued = asyncio.create_task(client.post(f"{srv.url}/v1/chat/completions", json=CHAT))
                    for _ in range(100):
                        await asyncio.sleep(0.05)
                        if srv.health()["queued"] == 1:
                            break
                    assert srv.health()["queued"] == 1
                    t0 = time.monotonic()
                    over = await client.post(f"{srv.url}/v1/chat/completions", json=CHAT)
                    assert over.status_code == 503 and over.headers["retry-after"] == "1"
                    assert time.monotonic() - t0 < 1
                # the first client went away mid-stream: its slot must serve the queued request promptly
                done = await asyncio.wait_for(queued, 10)
                assert done.status_code == 200

        asyncio.run(main())
        deadline = time.monotonic() + 5
        while srv.health()["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.health()["slots_busy"] == 0


def test_load_failure_is_reported_and_exits(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import PLUGIN_DIR

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "from ds4_core.cli import main; main()", "serve", "-m", str(bad),
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "listening on http://127.0.0.1:" in proc.stderr and "broken.gguf" in proc.stderr


def test_disk_cache_survives_restart(gguf, tmp_path):
    kv = tmp_path / "kv"
    convo = [{"role": "system", "content": "long system prompt " * 20}, {"role": "user", "content": "[[one]]"}]
    args = ("--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "16", "--kv-disk-space-mb", "8")
    with run_server(gguf, *args) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(model=MODEL, messages=convo)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert len(list(kv.glob("*.kv"))) == 1 and (kv.stat().st_mode & 0o777) == 0o700
    with run_server(gguf, *args) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        turn2 = [*convo, {"role": "assistant", "content": "one"}, {"role": "user", "content": "[[two]]"}]
        again = client.chat.completions.create(model=MODEL, messages=turn2)
    assert again.choices[0].message.content == "two"
    # the fresh process resumed from the first prompt's snapshot on disk
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
