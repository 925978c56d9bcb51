"""uvicorn's h11 protocol with a deadline for each request head (``guard.GuardConfig.uvicorn_options`` says
why); apart from ``guard.py`` so that the chat, which reads the serve flags' defaults, never imports uvicorn."""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head: armed when the connection opens and when a
    response ends, cancelled when a request head is complete; when it passes, the connection is closed."""
    header_timeout: float = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_late)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the request is the app's now
            self._head_timer.cancel()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # waiting for the next request head
            self._head_timer.cancel()
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_too_late(self) -> None:
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()
