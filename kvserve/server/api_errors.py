"""Errors in OpenAI's shape, and the renaming of engine fields to the HTTP fields clients sent."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvserve.errors import InvalidRequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad_request(param: str, message: str) -> APIError:
    """A 400 whose message starts with the field, as the engine's own errors do."""
    return APIError(400, f"{param}: {message}", param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "is-instance"}


def format_loc(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; drops pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or any(c in part for c in "[-'("):
            continue
        else:
            out += f".{part}" if out else part
    return out or "body"


def api_error_from_validation(err: ValidationError) -> APIError:
    first = err.errors()[0]
    param = format_loc(tuple(first["loc"]))
    return bad_request(param, first["msg"])


def api_error_from_invalid(e: InvalidRequestError, rename: dict[str, str]) -> APIError:
    """An engine validation error as a 400, renamed to the field the client sent."""
    field = e.field or "body"
    param = rename.get(field, field)
    message = str(e)
    if param != field and message.startswith(f"{field}:"):
        message = f"{param}:{message[len(field) + 1 :]}"
    return APIError(400, message, param=param)
