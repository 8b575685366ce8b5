"""ASGI middleware that runs before any handler: header bytes, the API key, the body size."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from .schemas import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _headers(scope) -> dict[str, str]:
    """Header names and values as text; a value that is not UTF-8 is a 400 naming the header
    (every route, /health too: decoding one used to raise, a 500)."""
    out = {}
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").lower()  # ASGI: bytes as sent; HTTP names are ASCII tokens
        try:
            out[name] = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, f"request header {name!r} is not valid UTF-8", name, "invalid_header") from None
    return out


class Guard:
    """Header encoding, bearer-key check and body-size limit, before any handler runs."""

    def __init__(self, app, api_key: str | None = None, max_body: int = 1 << 20):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check(scope)
        except APIError as err:
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)

    def check(self, scope) -> None:
        headers = _headers(scope)
        if self.api_key and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "invalid or missing API key", None, "invalid_api_key", "authentication_error")
        length = headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self.max_body:
            raise APIError(413, f"request body over {self.max_body} bytes", None, "body_too_large")
