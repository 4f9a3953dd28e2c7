"""Request plumbing shared by the HTTP routes: auth, body limits, JSON parsing, errors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loopstack.api.auth import AuthError, Principal
from loopstack.api.errors import APIError, from_validation_error
from loopstack.api.state import ServerState
from loopstack.experiments import ArmOverrideError, parse_arm_overrides


def state_of(request: Request) -> ServerState:
    return request.app.state.loopstack


def principal_of(request: Request) -> Principal:
    try:
        return state_of(request).keyring.authenticate(request.headers.get("authorization"))
    except AuthError as exc:
        raise APIError(str(exc), status=401, type="authentication_error", code=exc.code) from None


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"request body is {declared} bytes; the limit is {limit}", status=413, code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise APIError(f"request body exceeds the limit of {limit} bytes", status=413, code="body_too_large")
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError("request body must be a JSON object", code="invalid_json")
    return value


def parse_model(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def arm_overrides(request: Request, metadata: dict[str, Any] | None) -> dict[str, str]:
    header = state_of(request).live.current.stack.api.arm_override_header
    try:
        overrides = parse_arm_overrides(request.headers.get(header))
        overrides.update(parse_arm_overrides((metadata or {}).get("loopstack_arms")))
    except ArmOverrideError as exc:
        raise APIError(str(exc), param=header, code="invalid_arm_override") from None
    return overrides


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def handles_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return error_response(exc)

    wrapped.__name__ = endpoint.__name__
    return wrapped
