"""Schemathesis against the server's own OpenAPI document, in-process over ASGI with the scripted model.

Positive cases (schema-valid bodies, half of them naming the served model so they reach generation) must
get a documented status and content type, never a 5xx, and streams must end with their terminal event and
carry no in-band error. Negative cases (schema-invalid bodies) must be rejected with a 4xx.
"""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from conftest import MODEL, in_process_app
from ds4_server.app import create_app
from ds4_server.common import ServerConfig, ServerState
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

#: Examples per operation and mode; CI keeps it modest, DS4_FUZZ_EXAMPLES=100 for the full T9 target.
EXAMPLES = int(os.environ.get("DS4_FUZZ_EXAMPLES", "30"))
OPERATIONS = [(path, method.upper())
              for path, item in create_app(ServerState(ServerConfig())).openapi()["paths"].items() for method in item]
TERMINAL = {"/v1/chat/completions": "data: [DONE]", "/v1/completions": "data: [DONE]",
            "/v1/messages": "event: message_stop", "/v1/responses": "response.completed"}


def stream_is_whole(ctx, response, case) -> bool | None:
    """An SSE reply ends with its API's terminal event and holds no in-band error."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    text = response.content.decode()
    errors = [line for line in text.splitlines() if line.startswith("data: {") and '"error"' in line[:40]]
    assert not errors, f"in-band error: {errors[0]}"
    terminal = TERMINAL[case.operation.path]
    assert terminal in text or (terminal == "response.completed" and "response.incomplete" in text), \
        f"stream ended without {terminal!r}: {text[-300:]!r}"
    return True


@pytest.fixture(scope="module")
def api(gguf) -> schemathesis.schemas.BaseSchema:
    schema = schemathesis.openapi.from_asgi("/openapi.json", in_process_app(gguf, slots=2))
    schema.config.max_stream_events = 100_000  # read streams whole (the default stops after 20 events)
    return schema


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("path, method", OPERATIONS)
def test_schema_valid_requests_get_documented_answers_and_no_5xx(api, path, method):
    operation = api[path][method]

    @FUZZ
    @given(case=operation.as_strategy(), served=st.booleans())
    def check(case, served):
        if served and isinstance(case.body, dict):
            case.body["model"] = MODEL  # reach the model instead of stopping at the unknown-model 404
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                       response_schema_conformance, stream_is_whole])

    check()


@pytest.mark.parametrize("path, method", [op for op in OPERATIONS if op[1] == "POST"])
def test_schema_invalid_requests_are_rejected_with_4xx(api, path, method):
    operation = api[path][method]

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def check(case):
        case.call_and_validate(checks=[not_a_server_error, negative_data_rejection, status_code_conformance,
                                       content_type_conformance, response_schema_conformance])

    check()


def test_openapi_documents_native_errors_not_422(api):
    doc = api.raw_schema
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"400", "401", "404", "413", "503"} <= set(chat)
    assert "text/event-stream" in chat["200"]["content"]
    assert json.dumps(doc).count("HTTPValidationError") == 0
