"""A cap on request body size, enforced before any route parses the body."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

_DRAIN_LIMIT = 64 << 20


class BodyLimit:
    """Reads the whole body up front (refusing it with 413 past `max_bytes`), then replays it
    to the app; later receives go to the server, so disconnects are still seen."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(receive, send, message)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, message: Message) -> None:
        # Clients often only read the answer once their upload is done: drain a bounded
        # amount first so they see the 413 rather than a reset connection.
        drained = 0
        while message.get("more_body", False) and drained < _DRAIN_LIMIT:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
        payload = json.dumps(
            error_body(413, f"the request body is larger than {self.max_bytes} bytes")
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
