"""The orchestrator's side of the worker-to-worker chain (``data_plane = "chain"``).

A decode round (:mod:`~ethen.mesh.orchestrator.rounds`) of sessions sharing a route becomes one
``ChainRequest``: the orchestrator sends it to the first stage's worker (``Chain``, a ``.future()``: the ack
is off the critical path), each worker computes its stage for every session and sends the request on, and the
last one delivers it, with every stage's outputs, to the :class:`ChainReceiver` here (a gRPC server of
``MeshChainReceiver``). Per token the hidden state crosses the network once per stage plus once back: 4
one-way delays for 3 stages, where the star (one call per stage from the orchestrator) crosses 6.

Why: through delaying relays on namespaced hosts (``bench/mesh_hops.py --hosts``) the chain took 1.29x /
1.30x less time per step than the star at 5 / 20 ms one-way (0.85x at 0 ms, where its extra acks cost CPU);
``bench/mesh_hosts.py`` measures the real mesh both ways. The star stays the default.

Choices where the issue is silent:

- **Every stage's output comes back** (2.3 KB per stage per session): the session keeps each boundary's
  history for failover with replay exactly as with the star, so a chain step is recorded stage by stage.
- **Tickets**: each request carries 16 random bytes (``secrets``); the receiver hands a delivery only to the
  step waiting for that ticket, and ignores any other (late, replayed or forged). The receiver requires the
  mesh token like every worker (``UNAUTHENTICATED`` without it) and serves TLS when given a certificate.
- **Failures**: an item a worker could not compute, or whose next hop could not be reached (dead, cut off,
  stuck past the deadline), comes back marked with the failed node: the session fails over from there like a
  star round (stages already done keep their results). The step's deadline is one stage call's progress
  deadline (:func:`~ethen.mesh.orchestrator.rounds.call_timeout`), carried hop to hop as the gRPC deadline;
  the orchestrator waits 1.25 x that + 0.25 s. A step that never comes back at all
  (:class:`~ethen.mesh.orchestrator.errors.ChainLost`: the delivery itself failed) leaves it unknown which
  stages advanced, so the session rebuilds every stage by replay over the star (0 tokens lost).
- **Addresses**: workers reach each other at the addresses the orchestrator uses for them, and reach the
  receiver at ``advertise`` (default: the bound ``listen`` address).
- Prefill, replay and failover stay star (one ``Forward`` per stage, as before): only warm one-token decode
  steps are chained.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from ethen.mesh.auth import TokenAuth, TokenInterceptor
from ethen.mesh.orchestrator.errors import NodeError
from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["TICKET_BYTES", "ChainReceiver", "ChainStep"]

log = logging.getLogger("ethen.mesh.orchestrator")

TICKET_BYTES = 16


@dataclass
class ChainStep:
    """One chained request in flight: set by a delivery (or by the first hop's failed call)."""

    ticket: bytes
    done: threading.Event = field(default_factory=threading.Event)
    result: mesh_pb2.ChainRequest | None = None
    error: NodeError | None = None  # the first hop's call failed (nothing ran)


class ChainReceiver(mesh_pb2_grpc.MeshChainReceiverServicer):
    """Serves ``Deliver`` on ``listen`` (``host:port``; port 0: a free one), matches deliveries to steps."""

    def __init__(self, listen: str, advertise: str | None = None, *, tls: Any = None,
                 auth: TokenAuth | None = None) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"chain_listen = {listen!r}: must be 'host:port'")
        self._lock = threading.Lock()
        self._waiting: dict[bytes, ChainStep] = {}
        self.delivered = 0
        self.ignored = 0  # deliveries for no waiting ticket (late after a timeout, or forged)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ethen-chain-rx"),
            interceptors=[] if auth is None else [TokenInterceptor(auth)],
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0)])
        mesh_pb2_grpc.add_MeshChainReceiverServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        try:
            bound = (self._server.add_insecure_port(listen) if tls is None
                     else self._server.add_secure_port(listen, tls))
        except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
            bound = 0
        if bound == 0:
            self._server.stop(None)
            raise OSError(f"chain_listen = {listen!r}: cannot bind (in use?)")
        self._server.start()
        self.port = bound
        self.address = advertise or f"{host}:{bound}"

    def expect(self) -> ChainStep:
        step = ChainStep(secrets.token_bytes(TICKET_BYTES))
        with self._lock:
            self._waiting[step.ticket] = step
        return step

    def fail(self, step: ChainStep, error: NodeError) -> None:
        """The first hop's call failed: ``step`` ends with ``error`` (unless a delivery came first)."""
        with self._lock:
            if self._waiting.pop(step.ticket, None) is None:
                return
        step.error = error
        step.done.set()

    def wait(self, steps: Sequence[ChainStep], timeout_s: float) -> None:
        """Until every step is done or ``timeout_s`` passed; steps not done then are dropped (result None)."""
        deadline = time.monotonic() + timeout_s
        for step in steps:
            step.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for step in steps:
                self._waiting.pop(step.ticket, None)

    def Deliver(self, request: mesh_pb2.ChainRequest, context: Any) -> mesh_pb2.ChainAck:
        with self._lock:
            step = self._waiting.pop(request.ticket, None)
            if step is None:
                self.ignored += 1
            else:
                self.delivered += 1
        if step is not None:
            step.result = request
            step.done.set()
        return mesh_pb2.ChainAck()

    def close(self) -> None:
        self._server.stop(0.2)
