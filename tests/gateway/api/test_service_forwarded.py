"""``X-Forwarded-For`` only from ``[server] trusted_proxies``, and query-string secrets redacted in every log
(issue 42 item 10), against real ``ethen gateway --config`` processes on loopback (clients bind 127.0.0.2,
127.0.0.3 as their source address: Linux routes all of 127/8 to lo).

Before: uvicorn believed forwarded headers from 127.0.0.1 by default, so a local client logged any address it
named (100 spoofed addresses, 100 unknown-path lines for one path) and dodged the login throttle by naming a
new one per attempt; and ``--log-level debug`` wrote ``?api_key=...`` verbatim in uvicorn's access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from pathlib import Path

import httpx
import pytest

from ethen.admin.sessions import FREE_FAILURES
from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.observation.logformat import JsonFormatter, install_redaction, redact_query
from tests.gateway.api.test_service_slow_clients import gateway
from tests.gateway.service_harness import CLIENT_KEY, config_dict

ADMIN_KEY = "ethen-admin-7c1e2b3a4d5f6e7a8b9c0d1e2f3a4b5c"
ADMIN = {"log": {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}}
WRONG = {"admin_key": "ethen-admin-not-the-key"}
UNKNOWN_LINE = re.compile(r"unknown path: GET '/nope' from (\S+) ")


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10)


def _log(proc: object) -> str:
    proc.terminate()  # type: ignore[attr-defined]
    return str(proc.communicate(timeout=10)[0].decode())  # type: ignore[attr-defined]


def _spoofed(i: int) -> dict[str, str]:
    return {"x-forwarded-for": f"10.9.{i // 250}.{i % 250 + 1}"}


def test_forwarded_headers_are_ignored_by_default_even_from_loopback(tmp_path: Path) -> None:
    with gateway(tmp_path, sections=ADMIN) as (port, proc), _client("127.0.0.1") as me:
        base = f"http://127.0.0.1:{port}"
        for i in range(100):
            assert me.get(f"{base}/nope", headers=_spoofed(i)).status_code == 404
        # the login throttle keys on the peer: a new spoofed address per attempt is still one address
        logins = [me.post(f"{base}/ui/login", data=WRONG, headers=_spoofed(i)).status_code
                  for i in range(FREE_FAILURES + 1)]
        log = _log(proc)
    assert UNKNOWN_LINE.findall(log) == ["127.0.0.1"], log  # before: 100 lines, one per spoofed address
    assert logins == [401] * FREE_FAILURES + [429], logins  # before: all 401


def test_forwarded_headers_from_a_trusted_proxy_name_the_client(tmp_path: Path) -> None:
    with (gateway(tmp_path, sections=ADMIN, trusted_proxies=["127.0.0.2"], max_connections=20,
                  max_connections_per_client=2) as (port, proc),
          _client("127.0.0.2") as proxy, _client("127.0.0.3") as other):
        base = f"http://127.0.0.1:{port}"
        for i in range(3):
            assert proxy.get(f"{base}/nope", headers=_spoofed(i)).status_code == 404
            assert other.get(f"{base}/nope", headers=_spoofed(50 + i)).status_code == 404
        # the throttle counts the client the proxy names: 10.9.0.1 is locked, 10.9.0.2 is not
        logins = [proxy.post(f"{base}/ui/login", data=WRONG, headers=_spoofed(0)).status_code
                  for _ in range(FREE_FAILURES + 1)]
        fresh = proxy.post(f"{base}/ui/login", data=WRONG, headers=_spoofed(1)).status_code
        held, refused = asyncio.run(_hold_sockets(port))
        log = _log(proc)
    assert sorted(UNKNOWN_LINE.findall(log)) == ["10.9.0.1", "10.9.0.2", "10.9.0.3", "127.0.0.3"], log
    assert logins == [401] * FREE_FAILURES + [429] and fresh == 401, (logins, fresh)
    # the proxy's connections are not capped per address (max_connections_per_client = 2); others' are
    assert held == 6 and refused >= 1, (held, refused)  # (the other client's keep-alive one may count too)


async def _hold_sockets(port: int) -> tuple[int, int]:
    """Six sockets from the proxy and three from 127.0.0.3, each in a request (its body awaited); returns how
    many of the proxy's are still open and how many of the others' were refused."""
    head = (f"POST /api/gateway/v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {CLIENT_KEY}"
            "\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n").encode()
    socks: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
    try:
        for source, n in (("127.0.0.2", 6), ("127.0.0.3", 3)):
            socks[source] = []
            for _ in range(n):
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
                w.write(head)
                socks[source].append((r, w))
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        refused = 0
        for r, _ in socks["127.0.0.3"]:
            try:
                refused += b" 429 " in (await asyncio.wait_for(r.read(64), 0.3))[:16]
            except TimeoutError:
                pass
            except ConnectionError:  # closed at once, the 429 lost to the reset
                refused += 1
        held = sum(not r.at_eof() for r, _ in socks["127.0.0.2"])
    finally:
        for pairs in socks.values():
            for _, w in pairs:
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()
    return held, refused


SECRETS = ["sk-query-SECRET-1111", "tok-query-SECRET-2222", "k-query-SECRET-3333"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_query_secrets_are_redacted_in_the_access_log(tmp_path: Path, fmt: str) -> None:
    with gateway(tmp_path, cli=("--log-level", "debug", "--log-format", fmt)) as (port, proc):
        base = f"http://127.0.0.1:{port}/api/gateway/v1"
        auth = {"authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.get(f"{base}/models?api_key={SECRETS[0]}&page=2", headers=auth).status_code == 200
        assert httpx.get(f"{base}/nope?x=1&access_token={SECRETS[1]}").status_code == 404
        assert httpx.get(f"{base}/healthz?key={SECRETS[2]}").status_code == 200
        log = _log(proc)
    for secret in SECRETS:
        assert secret not in log, log
    assert "/models?api_key=[REDACTED]&page=2" in log, log  # the access log still shows the request
    assert "/healthz?key=[REDACTED]" in log, log
    if fmt == "json":
        assert any(json.loads(line)["logger"] == "uvicorn.access" for line in log.splitlines()
                   if line.startswith("{"))


def test_redact_query() -> None:
    assert redact_query("GET /a?api_key=s&b=1 HTTP/1.1") == "GET /a?api_key=[REDACTED]&b=1 HTTP/1.1"
    assert redact_query("/a?b=1&Token=s#f") == "/a?b=1&Token=[REDACTED]#f"
    assert redact_query("/a?X-Amz-Signature=s&client_secret=t&password=u") == (
        "/a?X-Amz-Signature=[REDACTED]&client_secret=[REDACTED]&password=[REDACTED]")
    assert redact_query("/a?model=m&page=2") == "/a?model=m&page=2"
    assert redact_query("key=v with no query") == "key=v with no query"


def test_every_record_is_redacted_args_and_traceback_included(caplog: pytest.LogCaptureFixture) -> None:
    install_redaction()
    install_redaction()  # idempotent
    log = logging.getLogger("ethen.test.redaction")
    with caplog.at_level(logging.INFO, logger="ethen.test.redaction"):
        log.info("GET %s %d", "/a?key=SECRET-A", 200)
        log.info("GET /b?token=SECRET-B")
        log.info("%(path)s", {"path": "/c?api_key=SECRET-C"})
        log.info("with an extra", extra={"url": "/e?secret=SECRET-E"})
        try:
            raise ValueError("https://upstream.example/v1/x?key=SECRET-D failed")
        except ValueError:
            log.exception("upstream call failed")
    text = "\n".join(caplog.text.splitlines() + [JsonFormatter().format(r) for r in caplog.records])
    for secret in ("SECRET-A", "SECRET-B", "SECRET-C", "SECRET-D", "SECRET-E"):
        assert secret not in text, text
    assert "/a?key=[REDACTED] 200" in caplog.text


@pytest.mark.parametrize("bad", [["nope"], ["10.0.0.0/33"], ["::1", "1.2.3"], "10.0.0.1", [5]])
def test_a_bad_trusted_proxies_entry_names_the_key_and_the_value(bad: object) -> None:
    data = config_dict("http://127.0.0.1:9")
    data["server"] = {"trusted_proxies": bad}
    with pytest.raises(GatewayConfigError, match=r"server\.trusted_proxies") as err:
        parse_config(data)
    assert repr(bad[-1] if isinstance(bad, list) else bad) in err.value.message


def test_trusted_proxies_default_to_none() -> None:
    cfg = parse_config(config_dict("http://127.0.0.1:9"))
    assert cfg.server.trusted_proxies == [] and cfg.server.trusted_networks == ()
    data = config_dict("http://127.0.0.1:9")
    data["server"] = {"trusted_proxies": ["10.0.0.0/8", "::1", " 192.168.1.7 "]}
    nets = parse_config(data).server.trusted_networks
    assert [str(n) for n in nets] == ["10.0.0.0/8", "::1/128", "192.168.1.7/32"]
