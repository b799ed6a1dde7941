"""The gate every HTTP request passes before a route: shutdown, API key, body size.

A plain ASGI middleware rather than FastAPI's `BaseHTTPMiddleware`, which would buffer
streaming responses and hide client disconnects from the routes.
"""

import json
import logging

from swiftlm.serve.auth import PUBLIC_PATHS, bearer_token, key_is_valid
from swiftlm.serve.errors import error_body

log = logging.getLogger("swiftlm.serve")


class ServerState:
    """What the gate needs to know, shared with the app and the runner."""

    def __init__(self, api_keys: tuple[str, ...], max_body_bytes: int):
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.draining = False  # set on SIGTERM: running requests finish, new ones get 503


class Gate:
    def __init__(self, app, state: ServerState, on_status=None):
        self.app = app
        self.state = state
        self.on_status = on_status  # called with the status code of every response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self._counting(send)
        refusal = self._refusal(scope)
        if refusal:
            return await _send_error(send, *refusal)
        body, too_big = await _read_body(receive, self.state.max_body_bytes)
        if too_big:
            limit = self.state.max_body_bytes
            return await _send_error(
                send, 413, f"the request body is larger than the limit of {limit} bytes"
            )
        await self._guarded(scope, _replay(body, receive), send)

    async def _guarded(self, scope, receive, send):
        """Run the app; a bug becomes a 500 OpenAI error instead of an exception that would
        make the server drop the connection."""
        started = False

        async def tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            log.exception("unexpected error while serving %s", scope["path"])
            if not started:  # a stream already under way can only be cut short
                message = f"internal server error ({type(exc).__name__}); see the server log"
                await _send_error(send, 500, message)

    def _counting(self, send):
        if self.on_status is None:
            return send

        async def counted(message):
            if message["type"] == "http.response.start":
                self.on_status(message["status"])
            await send(message)

        return counted

    def _refusal(self, scope) -> tuple[int, str, dict[str, str]] | None:
        if self.state.draining:
            return 503, "the server is shutting down; retry on another instance", {}
        if not self.state.api_keys or scope["path"] in PUBLIC_PATHS:
            return None
        headers = dict(scope["headers"])
        token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        if not key_is_valid(token, self.state.api_keys):
            message = "missing or invalid API key: send the header Authorization: Bearer <key>"
            return 401, message, {"www-authenticate": "Bearer"}
        return None


# An over-long body is still read (and dropped) up to this size before the 413 goes out: a
# client that is still sending when the server answers and closes would see a broken pipe
# instead of the error. Past it the server answers anyway.
DRAIN_LIMIT = 64 * 1024 * 1024


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
    """The whole request body, or (b"", True) when it is longer than `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            return b"".join(chunks), size > limit
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        if not message.get("more_body", False) or size > DRAIN_LIMIT:
            return (b"", True) if size > limit else (b"".join(chunks), False)


def _replay(body: bytes, receive):
    """A `receive` that gives the app the body read already, then the client's own messages
    (so the app still sees a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send, status: int, message: str, headers: dict[str, str] | None = None):
    payload = json.dumps(error_body(status, message)).encode("utf-8")
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
