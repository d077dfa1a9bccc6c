"""Slow clients against a real ``ethen gateway --config`` process (issue 10, item 14).

Real sockets on 127.0.0.1: 200 slowloris clients (one header byte every 0.5 s) are answered 408 and closed
after ``header_timeout_s`` while a normal client is served; a trickled body is cut at ``body_timeout_s``; past
``max_connections`` open connections a request gets 503 ``server_overloaded``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.api.test_service_cli import ethen_cmd, free_port, write_toml
from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
SLOW_CLIENTS = 200
BYTE_EVERY_S = 0.5
CHAT = "/api/gateway/v1/chat/completions"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
BODY = {"model": "ethen/cheap", "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def gateway(tmp_path: Path, *, cli: tuple[str, ...] = (), sections: dict[str, Any] | None = None,
            **server: Any) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A real ``ethen gateway --config`` process on 127.0.0.1 with ``[server]`` keys ``server``, extra config
    ``sections`` and extra command-line arguments ``cli`` (``--log-level debug``); its log is on its
    stdout."""
    with ServerThread(make_upstream_app(Script())) as up:
        port = free_port()
        data = config_dict(up.url)
        data["server"] = {"host": "127.0.0.1", "port": port, **server}
        data.update(sections or {})
        cfg = tmp_path / "gateway.toml"
        write_toml(data, cfg)
        env = {**os.environ, **ENV, "ETHEN_DATA_DIR": str(tmp_path / "data")}
        proc = subprocess.Popen([*ethen_cmd(), "gateway", "--config", str(cfg), *cli], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120  # a start-up bound
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/api/gateway/v1/healthz", timeout=1).is_success:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.1)
            yield port, proc
        finally:
            proc.terminate()
            proc.wait(10)


async def _trickle(port: int, head: bytes, trickle: bytes) -> tuple[float, bytes]:
    """Send ``head`` at once, then ``trickle`` one byte every BYTE_EVERY_S until the server answers or closes
    (bounded by the length of ``trickle``); returns (seconds until the server closed, what it sent)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    answer = asyncio.ensure_future(reader.read())  # everything until the server closes
    for byte in trickle:
        await asyncio.wait({answer}, timeout=BYTE_EVERY_S)
        if answer.done():
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            break
    try:
        data = await asyncio.wait_for(answer, timeout=3)
    finally:
        writer.close()
    return time.monotonic() - t0, data


def _error_of(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


async def _slowloris_while_serving(port: int) -> tuple[list[tuple[float, bytes]], list[int]]:
    request_line = f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode()
    slow = [asyncio.ensure_future(_trickle(port, request_line, b"x-slow: " + b"a" * 24))
            for _ in range(SLOW_CLIENTS)]
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=10) as client:
        await asyncio.sleep(0.5)  # every slow client is connected and trickling
        for _ in range(3):
            r = await client.post(f"http://127.0.0.1:{port}{CHAT}", headers=AUTH, json=BODY)
            statuses.append(r.status_code)
            await asyncio.sleep(0.3)
    return list(await asyncio.gather(*slow)), statuses


def test_slowloris_clients_get_408_after_the_header_timeout_while_others_are_served(tmp_path: Path) -> None:
    # the header timeout alone: the per-address cap on slow sockets (32 by default) would close most of these
    # 200 first (tests/gateway/api/test_service_client_caps.py)
    with gateway(tmp_path, header_timeout_s=HEADER_TIMEOUT_S,
                 max_pending_headers_per_client=SLOW_CLIENTS) as (port, _):
        slow, statuses = asyncio.run(_slowloris_while_serving(port))
    assert statuses == [200, 200, 200]
    for took, raw in slow:
        assert HEADER_TIMEOUT_S - 0.1 <= took <= HEADER_TIMEOUT_S + 2.0, took
        status, error = _error_of(raw)
        assert (status, error["code"]) == (408, "request_timeout")


def test_a_trickled_body_is_cut_at_the_body_timeout(tmp_path: Path) -> None:
    body = json.dumps(BODY).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {CLIENT_KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    with gateway(tmp_path, body_timeout_s=BODY_TIMEOUT_S) as (port, proc):
        took, raw = asyncio.run(_trickle(port, head, body[:20]))  # 20 bytes at 2/s: 10 s, never complete
        ok = httpx.post(f"http://127.0.0.1:{port}{CHAT}", content=body, timeout=10,
                        headers={"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"})
        assert ok.status_code == 200
        proc.terminate()
        log = proc.communicate(timeout=10)[0].decode()
    assert BODY_TIMEOUT_S - 0.1 <= took <= BODY_TIMEOUT_S + 2.0, took
    status, error = _error_of(raw)
    assert (status, error["code"]) == (408, "request_timeout")
    assert "Exception in ASGI application" not in log, log  # a client's slowness is no server error


def test_past_max_connections_a_request_gets_503_until_slow_ones_are_closed(tmp_path: Path) -> None:
    url = "/api/gateway/v1/healthz"

    async def run(port: int) -> tuple[httpx.Response, httpx.Response]:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]  # connected, silent
        async with httpx.AsyncClient(timeout=10) as client:
            refused = await client.get(f"http://127.0.0.1:{port}{url}")
            await asyncio.sleep(HEADER_TIMEOUT_S + 0.5)  # the silent ones are closed by the header timeout
            served = await client.get(f"http://127.0.0.1:{port}{url}")
        for _, writer in idle:
            writer.close()
        return refused, served

    # one address may hold all 5 here (max_connections_per_client: test_service_client_caps.py)
    with gateway(tmp_path, max_connections=5, max_connections_per_client=5,
                 header_timeout_s=HEADER_TIMEOUT_S) as (port, _):
        refused, served = asyncio.run(run(port))
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_overloaded"
    assert served.status_code == 200


@pytest.mark.parametrize(("key", "value"), [("header_timeout_s", 0), ("body_timeout_s", -1.0),
                                            ("max_connections", 0), ("header_timeout_s", "10"),
                                            ("max_connections_per_client", 0),
                                            ("max_connections_per_client", 1001),
                                            ("max_pending_headers_per_client", 0),
                                            ("max_pending_headers_per_client", "32")])
def test_server_limits_are_checked_and_errors_name_key_and_value(key: str, value: object) -> None:
    data = config_dict("http://127.0.0.1:9")
    data["server"] = {key: value}
    with pytest.raises(GatewayConfigError) as excinfo:
        parse_config(data)
    assert f"server.{key} = {value!r}" in excinfo.value.message


def test_server_limits_default() -> None:
    cfg = parse_config(config_dict("http://127.0.0.1:9"))
    server = cfg.server
    assert (server.header_timeout_s, server.body_timeout_s, server.max_connections) == (10.0, 60.0, 1000)
    assert (server.connections_per_client, server.max_pending_headers_per_client) == (500, 32)


def test_the_per_client_cap_may_not_exceed_the_global_one() -> None:
    data = config_dict("http://127.0.0.1:9")
    data["server"] = {"max_connections": 10, "max_connections_per_client": 11}
    with pytest.raises(GatewayConfigError) as excinfo:
        parse_config(data)
    assert "server.max_connections_per_client = 11: must be at most server.max_connections (10)" in (
        excinfo.value.message)
    data["server"] = {"max_connections": 10, "max_connections_per_client": 10}  # no reserve: behind a proxy
    assert parse_config(data).server.connections_per_client == 10
    data["server"] = {"max_connections": 1}
    assert parse_config(data).server.connections_per_client == 1


def test_a_client_still_writing_after_its_408_reads_the_answer_and_no_reset(tmp_path: Path) -> None:
    """Lingering close: after the 408 the server shuts its write side and drops what the client still sends,
    so the client's writes do not draw a reset (closing a socket with unread input sends one, and a reset
    can destroy the answer before the client reads it: a CI run's trickler got ECONNRESET, not its 408)."""

    async def run(port: int) -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ".encode())
        answer = await asyncio.wait_for(reader.readuntil(b"}}"), HEADER_TIMEOUT_S + 5)  # the 408's envelope
        for _ in range(5):  # the client goes on: each write must be taken (a closed socket resets the 2nd)
            writer.write(b"a" * 1000)
            await writer.drain()
            await asyncio.sleep(0.1)
        rest = await asyncio.wait_for(reader.read(), 5)  # then a clean end of file
        writer.close()
        return answer, rest

    with gateway(tmp_path, header_timeout_s=HEADER_TIMEOUT_S) as (port, _):
        answer, rest = asyncio.run(run(port))
    assert (_error_of(answer)[0], _error_of(answer)[1]["code"]) == (408, "request_timeout")
    assert rest == b""
