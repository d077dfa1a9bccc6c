"""``POST /ui/login`` throttled per client address, and a client disconnect logged as what it is (issue 23,
item 7), against a real ``ethen gateway --config`` process on 127.0.0.1 (the other address, 127.0.0.2, is
bound as the client socket's source: Linux routes all of 127/8 to lo).

Before: 300 wrong keys were all answered 401 within 0.2 s, and a body cut off by the client was logged as an
"unhandled error" with a traceback.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ethen.admin.sessions import FREE_FAILURES, LoginThrottle
from tests.gateway.api.test_service_cli import ethen_cmd, free_port, write_toml
from tests.gateway.service_harness import CLIENT_KEY, ENV, config_dict
from tests.gateway.upstream import Script, ServerThread, make_upstream_app

ADMIN_KEY = "ethen-admin-7c1e2b3a4d5f6e7a8b9c0d1e2f3a4b5c"
WRONG = {"admin_key": "ethen-admin-not-the-key"}
RIGHT = {"admin_key": ADMIN_KEY}


@contextmanager
def gateway(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    with ServerThread(make_upstream_app(Script())) as up:
        port = free_port()
        data = config_dict(up.url)
        data["server"] = {"host": "127.0.0.1", "port": port}
        data["log"] = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
        cfg = tmp_path / "gateway.toml"
        write_toml(data, cfg)
        env = {**os.environ, **ENV, "ETHEN_DATA_DIR": str(tmp_path / "data")}
        cmd = [*ethen_cmd(), "gateway", "--config", str(cfg), "--log-level", "info"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10)


def test_repeated_wrong_keys_from_one_address_are_answered_429_with_retry_after(tmp_path: Path) -> None:
    with gateway(tmp_path) as (port, _), _client("127.0.0.1") as me, _client("127.0.0.2") as other:
        url = f"http://127.0.0.1:{port}/ui/login"
        t0 = time.monotonic()
        answers = [me.post(url, data=WRONG) for _ in range(300)]
        took = time.monotonic() - t0
        statuses = [r.status_code for r in answers]
        # the lock: 1 s after the 5th failure, doubling per failure let through after it (1+2+4+8+16 = 31 s)
        assert statuses[:FREE_FAILURES] == [401] * FREE_FAILURES, statuses[:10]
        assert statuses[FREE_FAILURES] == 429, statuses[:10]
        assert set(statuses) == {401, 429}
        assert statuses.count(401) <= FREE_FAILURES + 5, (statuses.count(401), took)
        locked = answers[FREE_FAILURES]
        assert 1 <= int(locked.headers["retry-after"]) <= 60
        assert "Too many failed sign-ins" in locked.text

        # while locked, the right key is refused too (the lock is no oracle); another address is not locked
        for _ in range(100):  # bounded: reach a lock with more than a second left
            r = me.post(url, data=WRONG)
            if r.status_code == 429 and int(r.headers["retry-after"]) >= 2:
                break
            time.sleep(0.2 if r.status_code == 429 else 0)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 2, r.headers
        assert me.post(url, data=RIGHT).status_code == 429
        assert other.post(url, data=WRONG).status_code == 401
        assert other.post(url, data=RIGHT).status_code == 303

        # after the lock, the right key signs in and resets the address: 5 failures again before a lock
        time.sleep(int(r.headers["retry-after"]) + 0.2)
        assert me.post(url, data=RIGHT).status_code == 303
        again = [me.post(url, data=WRONG).status_code for _ in range(FREE_FAILURES + 1)]
        assert again == [401] * FREE_FAILURES + [429]


def test_a_client_disconnect_is_logged_as_such_not_as_an_unhandled_error(tmp_path: Path) -> None:
    body = b'{"model": "ethen/cheap", "messages": [{"role": "user", "content": "hi"}]}'
    with gateway(tmp_path) as (port, proc):
        for path in ("/api/gateway/v1/chat/completions", "/ui/login"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {CLIENT_KEY}\r\n"
                          f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                          + body[:20])
                time.sleep(0.3)  # the app is reading the body
            time.sleep(0.3)  # the server saw the connection end
        headers = {"authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json"}
        served = httpx.post(f"http://127.0.0.1:{port}/api/gateway/v1/chat/completions", content=body,
                            headers=headers)
        assert served.status_code == 200
        proc.terminate()
        log = proc.communicate(timeout=10)[0].decode()
    assert "unhandled error" not in log, log
    assert "Traceback" not in log, log
    assert "client disconnected on /api/gateway/v1/chat/completions before its request was read" in log, log
    assert "client disconnected on /ui/login before its request was read" in log, log


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_lock_doubles_up_to_its_bound_and_success_or_time_forgets_it() -> None:
    clock = Clock()
    t = LoginThrottle(clock=clock)
    locks = [t.failed("a") for _ in range(14)]
    assert locks == [0.0] * 4 + [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0]
    assert t.retry_after("a") == 60.0 and t.retry_after("b") == 0.0
    clock.now += 59.5
    assert t.retry_after("a") == 0.5
    t.succeeded("a")
    assert t.retry_after("a") == 0.0 and len(t) == 0
    for _ in range(4):
        t.failed("a")
    clock.now += 901  # failures 15 min old are forgotten
    assert t.failed("a") == 0.0


def test_the_throttle_table_is_bounded() -> None:
    clock = Clock()
    t = LoginThrottle(max_addresses=100, clock=clock)
    for i in range(10_000):
        t.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(t) == 100
    for _ in range(5):
        t.failed("10.0.39.15")  # the newest of them keeps its failures in a row
    assert t.retry_after("10.0.39.15") > 0
    assert t.retry_after("10.0.0.0") == 0.0  # the oldest were dropped
