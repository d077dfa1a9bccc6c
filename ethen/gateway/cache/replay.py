"""Streams in and out of the cache, as :class:`~ethen.gateway.providers.base.ProviderStream` s, so the
gateway's relay (:class:`~ethen.gateway.api.relay.StreamRelay`) and the Responses / Messages stream
translations serve a cached stream exactly as a live one.

- :class:`RecordingStream` wraps a live upstream stream: it passes every chunk on and keeps a copy; when the
  upstream ends the answer properly (``completed``) it hands the chunks to ``on_complete`` (the cache's
  write). A stream cut by an error or by the client leaves nothing behind.
- :class:`ReplayStream` yields a stored stream's chunks after the first (the relay sends ``first`` itself),
  with no usage: a hit costs nothing and reports no tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ethen.gateway.providers.base import ProviderStream

__all__ = ["RecordingStream", "ReplayStream"]


class ReplayStream(ProviderStream):
    """The chunks of a stored stream after its first."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self._chunks = iter(chunks)
        self.completed = False

    async def __anext__(self) -> bytes:
        try:
            return next(self._chunks)
        except StopIteration:
            self.completed = True
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        return None


class RecordingStream(ProviderStream):
    """A live stream whose chunks (``first`` included) are kept; ``on_complete(chunks)`` once it completed."""

    def __init__(self, inner: ProviderStream, first: bytes,
                 on_complete: Callable[[list[bytes]], None]) -> None:
        self.inner = inner
        self.chunks: list[bytes] | None = [first]
        self.on_complete = on_complete
        self.receipt_extra = inner.receipt_extra

    async def __anext__(self) -> bytes:
        inner = self.inner
        try:
            payload = await inner.__anext__()
        except StopAsyncIteration:
            self._sync()
            chunks, self.chunks = self.chunks, None
            if inner.completed and chunks is not None:
                self.on_complete(chunks)
            raise
        except BaseException:
            self.chunks = None
            self._sync()
            raise
        if self.chunks is not None:
            self.chunks.append(payload)
        self._sync()
        return payload

    def _sync(self) -> None:
        inner = self.inner
        self.usage = inner.usage
        self.completed = inner.completed
        self.receipt_extra = inner.receipt_extra

    async def aclose(self) -> None:
        self.chunks = None
        await self.inner.aclose()
