"""What every admin route shares: the error shape and reading a JSON object body."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error"}


def admin_error(status: int, code: str, message: str, param: str | None = None, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped error (``{"error": {type, code, param, message}}``), plus any extra
    fields a client can act on (e.g. ``current_revision``)."""
    body = {"error": {"type": ERROR_TYPES.get(status, "api_error"), "code": code, "param": param,
                      "message": message, **extra}}
    return JSONResponse(body, status_code=status)


class NotAnObject(ValueError):
    """The body was not a JSON object."""


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or NotAnObject."""
    try:
        payload = await request.json()
    except ValueError:
        raise NotAnObject from None
    if not isinstance(payload, dict):
        raise NotAnObject
    return payload


BAD_BODY = ("invalid_json", "the body must be a JSON object")
