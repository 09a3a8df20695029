"""Start real ``ds4 serve`` subprocesses on loopback with the scripted model plugin installed on PYTHONPATH."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ds4_server.app import create_app, load_into
from ds4_server.common import ServerConfig, ServerState
from fastapi import FastAPI

PLUGIN_DIR = Path(__file__).parent / "scripted_plugin"
sys.path.insert(0, str(PLUGIN_DIR))

from ds4_scripted_fixture import write_scripted_gguf  # noqa: E402

MODEL = "scripted"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()


@contextlib.contextmanager
def run_server(gguf: Path, *args: str, env: dict | None = None) -> Iterator[Server]:
    """``ds4 serve -m gguf --port 0 ARGS`` until it answers /health with 200; stopped on exit."""
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-c", "from ds4_core.cli import main; main()", "serve", "-m", str(gguf), "--port", "0",
           "--alias", MODEL, *args]
    proc = subprocess.Popen(cmd, env=environ, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"ds4 serve exited with {proc.returncode}")
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
        assert url, "ds4 serve never printed its address"
        while time.monotonic() < deadline:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
            time.sleep(0.05)
        yield Server(proc, url)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def in_process_app(gguf: Path, **options: object) -> FastAPI:
    """The server's ASGI app over a loaded scripted model, without a subprocess (``options``: ServerConfig fields)."""
    state = ServerState(ServerConfig(model_path=gguf, aliases=(MODEL,), **options))
    load_into(state)
    assert state.pool is not None, state.load_error
    return create_app(state)


@pytest.fixture(scope="session")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_gguf(tmp_path_factory.mktemp("model") / "scripted.gguf")


@pytest.fixture(scope="session")
def slow_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_gguf(tmp_path_factory.mktemp("slow") / "slow.gguf", delay_ms=20)


@pytest.fixture(scope="session")
def server(gguf: Path) -> Iterator[Server]:
    trace = str(gguf.parent / "trace.jsonl")
    with run_server(gguf, "--batched-session", "4", "--trace", trace) as srv:
        yield srv
