"""The server's front door, as pure ASGI middleware: authentication before the body is read, and a
bound on the body's size (both answered with OpenAI's error body; nothing reaches FastAPI)."""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health", "/dashboard"})  # no key needed (the dashboard page asks for /state)
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


async def _send_error(send, status: int, message: str, type_: str, code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            await _send_error(send, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              "invalid_request_error", "invalid_api_key")
            return
        too_large = (f"request body larger than {self.max_body_bytes} bytes", "invalid_request_error",
                     "body_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, 413, *too_large)
            return
        # Read the body here (bounded), then hand it on: a chunked upload without a length is cut off too.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, 413, *too_large)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel (disconnects)

        await self.app(scope, replay, send)
