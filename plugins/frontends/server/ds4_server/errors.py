"""HTTP errors and their bodies in each API's native shape (OpenAI or Anthropic)."""

from __future__ import annotations

from typing import Any

from ds4_core.errors import Ds4Error

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable_error"}


class ApiError(Ds4Error):
    """A request failure with an HTTP status; rendered in the calling API's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def is_anthropic_path(path: str) -> bool:
    """True for the Anthropic Messages routes, whose clients expect Anthropic-shaped errors."""
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON error body for ``status`` as the API at ``path`` shapes it."""
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"code": status, "message": message, "param": param,
                      "type": _OPENAI_TYPES.get(status, "server_error")}}
