"""A request must arrive in time: its headers within `request_read_timeout_s` of the connection
opening (or of the request's first byte on a kept-alive connection), and its body without a
pause longer than that. Otherwise the server answers 408 and closes the connection, so a client
that opens connections and sends nothing, or sends headers and stalls, holds no connection,
task or upload slot for long. An idle keep-alive connection closes after `timeout_keep_alive_s`
(uvicorn's own timer).

The header deadline lives in the HTTP protocol (`HeaderDeadlineProtocol`, uvicorn's httptools
protocol: the app is not called before the headers are complete); the body deadline in an ASGI
middleware (`BodyReadDeadline`), which every route's reads go through.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.settings import ServerSettings

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn serves on h11, without a header deadline
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def request_timeout(what: str, timeout_s: float) -> APIError:
    """408 in OpenAI's shape; the connection closes after it."""
    return APIError(
        408,
        f"The request's {what} did not arrive within {timeout_s:g} s (--request-read-timeout).",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def _raw_response(error: APIError) -> bytes:
    """`error` as a complete HTTP/1.1 response, written straight to a connection."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


if HttpToolsProtocol is not None:

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a deadline on each request's headers.

        The deadline is armed when the connection opens and when a request's first byte
        arrives, and disarmed when its headers are complete; past it the connection gets a 408
        and is closed (uvicorn alone waits for headers forever)."""

        def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_timeout_s = header_timeout_s
            self._header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def _arm(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(
                    self.header_timeout_s, self._headers_too_late
                )

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_late(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                error = request_timeout("headers", self.header_timeout_s)
                self.transport.write(_raw_response(error))
                self.transport.close()


class BodyReadDeadline:
    """ASGI middleware: while a request's body is still arriving, each read waits at most
    `timeout_s`; a longer pause raises a 408 `APIError` in the route that reads. Once the body
    is complete, reads pass through untimed (they then wait for a disconnect)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise request_timeout("body", self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, receive_in_time, send)


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """uvicorn.Config options that enforce `settings`' connection timeouts."""
    options: dict[str, Any] = {"timeout_keep_alive": settings.timeout_keep_alive_s}
    if HttpToolsProtocol is not None:
        options["http"] = functools.partial(
            HeaderDeadlineProtocol, header_timeout_s=settings.request_read_timeout_s
        )
    return options
