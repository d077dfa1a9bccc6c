"""The gRPC channel options of every mesh channel that carries hidden states (orchestrator -> worker,
worker -> worker in a chain): 64 MiB messages both ways, no gRPC-level retries (the orchestrator fails over
itself), and a quick reconnect (100 ms, at most 1 s) after a worker restarts."""

from __future__ import annotations

__all__ = ["CHANNEL_OPTIONS"]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
