"""OpenAI-style errors: every 4xx names the parameter at fault."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.extra = dict(extra or {})  # more fields of the error object (a guard's verdict)

    def body(self) -> dict[str, Any]:
        fields = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**self.extra, **fields}}


def from_validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """The first pydantic error as an APIError naming its field (all of them in the message)."""
    errors = exc.errors(include_url=False)
    parts = []
    for error in errors:
        field = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{prefix}{field}: {error['msg'].replace('Value error, ', '')}")
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return APIError("; ".join(parts), param=f"{prefix}{first}" if first else None, code="invalid_value")


def not_found(what: str, identifier: str, param: str | None = None) -> APIError:
    return APIError(f"{what} with id '{identifier}' not found.", status=404, param=param, code=f"{what.replace(' ', '_')}_not_found")
