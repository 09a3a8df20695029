"""T15 default bind and the exposure warning; T19 disconnect storm against a real ``ds4 serve`` subprocess."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from conftest import MODEL, PLUGIN_DIR, run_server
from ds4_server.app import exposure_warning


def test_default_bind_is_loopback_only(server):
    listening = [c.laddr for c in psutil.Process(server.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    assert not any("warning: listening" in line for line in server.stderr)


@pytest.mark.parametrize("host, key, warns", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("127.0.0.2", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("[::]", None, True), ("192.168.1.5", None, True),
    ("myhost.example", None, True), ("0.0.0.0", "k", False)])
def test_exposure_warning(host, key, warns):
    assert (exposure_warning(host, key) is not None) == warns


def test_exposed_host_without_key_warns_at_startup(gguf):
    """``--host 0.0.0.0`` prints the warning before binding; the port is held on loopback so it never listens."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([sys.executable, "-c", "from ds4_core.cli import main; main()", "serve", "-m",
                                 str(gguf), "--host", "0.0.0.0", "--port", str(port)], env=env,
                                stderr=subprocess.PIPE, text=True)
        try:
            err = proc.communicate(timeout=30)[1]  # Linux refuses 0.0.0.0:port while 127.0.0.1:port listens
        except subprocess.TimeoutExpired:  # a system that allowed the bind: stop it
            proc.terminate()
            err = proc.communicate(timeout=30)[1]
    first = err.splitlines()[0]
    assert first.startswith("warning: listening on 0.0.0.0 without --api-key"), err
    assert "cannot listen on 0.0.0.0 port" in err or "listening on http://0.0.0.0" in err


def test_disconnect_storm_frees_every_slot_within_a_second(slow_gguf):
    """200 clients, streaming or not, abort at random points: queued, in prefill, in decode."""
    rng = random.Random(19)
    script = "[[" + "the " * 150 + "]]"  # ~300-token prompt (3 prefill steps) and a ~300-token reply
    with run_server(slow_gguf, "--batched-session", "4", "--queue-limit", "256") as srv:
        url = f"{srv.url}/v1/chat/completions"

        async def client(http: httpx.AsyncClient, i: int) -> float:
            stream = rng.random() < 0.5
            body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": f"{i} {script}"}]}

            async def talk() -> None:
                if not stream:
                    await http.post(url, json=body)
                    return
                async with http.stream("POST", url, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            try:  # leaving early drops the connection: no keep-alive, so nothing is reused
                await asyncio.wait_for(talk(), rng.uniform(0.0, 1.5))
            except TimeoutError:
                pass
            return time.monotonic()

        async def storm() -> float:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=30, limits=limits) as http:
                return max(await asyncio.gather(*(client(http, i) for i in range(200))))

        last_abort = asyncio.run(storm())
        while (health := srv.health())["slots_busy"] or health["queued"]:
            assert time.monotonic() - last_abort < 1.0, health
            time.sleep(0.02)
        freed_after = time.monotonic() - last_abort
        assert freed_after <= 1.0
        # the server still answers normally afterwards
        ok = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "[[ok]]"}]}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_serve_without_model_uses_the_embedded_tiny_deepseek_v4():
    """``ds4 serve`` with no -m loads the embedded tiny DeepSeek V4 and answers the openai SDK."""
    import openai

    cmd = [sys.executable, "-c", "from ds4_core.cli import main; main()", "serve", "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "ds4 serve exited"
            if line.startswith("ds4 serve: listening on "):
                url = line.split()[-1]
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the tiny model never became ready"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        assert model.model_extra["meta"]["family"] == "deepseek4"
        reply = client.chat.completions.create(model=model.id, max_tokens=4, temperature=0, reasoning_effort="none",
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length") and 0 < reply.usage.completion_tokens <= 4
        assert reply.usage.prompt_tokens > 0
    finally:
        proc.terminate()
        proc.wait(10)
