"""T13: every registered route × {no key, wrong key, Bearer, x-api-key} under --api-key (in-process ASGI)."""

from __future__ import annotations

import re
from pathlib import Path

import ds4_server
import pytest
from conftest import MODEL, in_process_app
from starlette.routing import BaseRoute
from starlette.testclient import TestClient

KEY = "s3cret-key"
USER = [{"role": "user", "content": "hi"}]
#: Valid bodies, so that a request let through is answered 200, not refused for its body.
BODIES = {"/v1/chat/completions": {"model": MODEL, "messages": USER},
          "/v1/completions": {"model": MODEL, "prompt": "hi"},
          "/v1/responses": {"model": MODEL, "input": "hi"},
          "/v1/responses/input_tokens": {"model": MODEL, "input": "hi"},
          "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": USER},
          "/v1/messages/count_tokens": {"model": MODEL, "messages": USER}}
CREDENTIALS = {"none": {}, "wrong bearer": {"authorization": f"Bearer {KEY}x"}, "wrong x-api-key": {"x-api-key": "x"},
               "key without Bearer": {"authorization": KEY}, "empty bearer": {"authorization": "Bearer "}}
GOOD = {"bearer": {"authorization": f"Bearer {KEY}"}, "x-api-key": {"x-api-key": KEY}}


def registered_routes(routes: list[BaseRoute]) -> list[tuple[str, str]]:
    """(method, path) of every route the app would dispatch to, included routers and docs pages included."""
    found = []
    for route in routes:
        if hasattr(route, "path"):
            found += [(m, route.path) for m in sorted(getattr(route, "methods", None) or {"GET"}) if m != "HEAD"]
        else:  # FastAPI wraps an included router: walk into it
            found += registered_routes(route.original_router.routes)
    return found


@pytest.fixture(scope="module")
def app(gguf):
    return in_process_app(gguf, api_key=KEY)


@pytest.fixture(scope="module")
def client(app) -> TestClient:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def routes(app) -> list[tuple[str, str]]:
    found = registered_routes(app.routes)
    documented = {(m.upper(), p) for p, item in app.openapi()["paths"].items() for m in item}
    assert documented <= set(found), "the route walk missed routes the OpenAPI document lists"
    assert {("GET", "/openapi.json"), ("GET", "/docs")} <= set(found)
    return found


def test_only_health_is_public_and_refusals_are_native_401(client, routes):
    refused = 0
    for method, path in routes:
        for name, headers in CREDENTIALS.items():
            r = client.request(method, path, json=BODIES.get(path), headers=headers)
            if path == "/health":
                assert r.status_code == 200, (name, r.text)
                continue
            assert r.status_code == 401, (method, path, name, r.status_code)
            body = r.json()
            if path.startswith("/v1/messages"):
                assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
            else:
                assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
            assert r.headers["www-authenticate"] == "Bearer"
            refused += 1
    assert refused == (len(routes) - 1) * len(CREDENTIALS)


@pytest.mark.parametrize("style", GOOD)
def test_the_key_opens_every_route_either_way(client, routes, style):
    for method, path in routes:
        r = client.request(method, path, json=BODIES.get(path), headers=GOOD[style])
        assert r.status_code == 200, (method, path, r.text[:200])


def test_unknown_paths_do_not_tell_what_exists_without_a_key(client):
    assert client.get("/v1/secret-admin").status_code == 401
    assert client.get("/v1/secret-admin", headers=GOOD["bearer"]).status_code == 404


def test_keys_are_compared_in_constant_time():
    """Grep: the key is only ever compared through hmac.compare_digest, never with == / != / in."""
    sources = {p.name: p.read_text() for p in Path(ds4_server.__file__).parent.glob("*.py")}
    assert "hmac.compare_digest" in sources["app.py"]
    secret = r"(self\.key|[\w.]*api_key)"
    pattern = re.compile(rf"{secret}\s*(==|!=|\bin\b)|(==|!=)\s*{secret}"
                         r"|\b(token|given)\s*(==|!=)|(==|!=)\s*(token|given)\b")
    uses = [(name, line.strip()) for name, text in sources.items() for line in text.splitlines()
            if pattern.search(line) and (name == "app.py" or "api_key" in line or "self.key" in line)]
    assert not uses, f"key compared outside hmac.compare_digest: {uses}"
