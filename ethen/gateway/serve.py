"""Serve a gateway app with uvicorn: the one server loop of ``ethen gateway --config`` and ``ethen up``.

Choice: SIGINT/SIGTERM start uvicorn's graceful shutdown (the lifespan closes the providers: HTTP pools, the
mesh orchestrator) and :func:`serve` then returns normally. Stock ``uvicorn.Server`` re-raises the signal once
it has shut down, from inside its event loop, where asyncio's own SIGINT handler turned a clean Ctrl-C into a
``KeyboardInterrupt`` traceback logged by the lifespan, and SIGTERM into death by signal before the caller's
clean-up (``ethen up`` stopping its workers) could run. A second Ctrl-C still forces the exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

__all__ = ["GatewayServer", "serve"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` whose signal capture shuts down gracefully without re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: Any, *, host: str, port: int, log_level: str = "warning",
          on_started: Callable[[], None] | None = None) -> bool:
    """Run ``app`` until a signal; ``on_started`` runs (in a thread) once the port accepts connections.
    Returns whether the server started (``False``: the lifespan start-up failed or the port was taken)."""
    level = log_level.lower()
    server = GatewayServer(uvicorn.Config(app, host=host, port=port, log_level=level,
                                          access_log=level == "debug", lifespan="on"))
    if on_started is not None:
        def watch() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                on_started()

        threading.Thread(target=watch, name="ethen-started", daemon=True).start()
    server.run()
    return bool(server.started)
