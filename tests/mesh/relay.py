"""A TCP relay that delays every chunk by D ms each way (test and bench infrastructure, not in ``ethen``).

This kernel has no ``netem`` qdisc, so the namespaced test hosts (:mod:`tests.mesh.netns`) put this relay in
front of each worker's port: ``listen -> target`` with each chunk read from one side written to the other
``delay_ms`` after it arrived, in order, each direction on its own (a link with latency D and no bandwidth
cap). The same process serves an echo port through the same delaying code, so the added round trip can be
measured (``2 * D`` plus the relay's own cost).

Run: ``python -m tests.mesh.relay --listen HOST:PORT --target HOST:PORT --echo HOST:PORT --delay-ms D``. It
prints ``READY <listen port> <echo port>`` once both listen; each line ``delay D`` on stdin sets the delay for
the chunks that arrive from then on (answers ``OK delay D``); end-of-file on stdin stops it (so it dies with
its parent). Buffers are bounded: at most 64 chunks of 64 KiB wait per direction, then the reader waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time

__all__ = ["Relay", "main"]

CHUNK = 65536
QUEUED_CHUNKS = 64


class Relay:
    def __init__(self, delay_ms: float) -> None:
        self.delay_s = delay_ms / 1000.0

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=QUEUED_CHUNKS)

        async def read() -> None:
            last_due = 0.0
            try:
                while data := await reader.read(CHUNK):
                    # in order: a delay lowered mid-stream never lets a chunk pass an earlier one
                    last_due = max(time.monotonic() + self.delay_s, last_due)
                    await queue.put((last_due, data))
            except (ConnectionError, OSError):
                pass
            await queue.put((0.0, b""))

        async def write() -> None:
            try:
                while True:
                    due, data = await queue.get()
                    if not data:
                        break
                    wait = due - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
            except (ConnectionError, OSError):
                pass

        reading = asyncio.create_task(read())
        try:
            await write()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    async def handle(self, target: tuple[str, int], client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        _nodelay(client_w)
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:  # the worker is down: the caller sees the connection close
            client_w.close()
            return
        _nodelay(server_w)
        try:
            await asyncio.gather(self._pump(client_r, server_w), self._pump(server_r, client_w))
        finally:
            for w in (client_w, server_w):
                w.close()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _nodelay(writer)
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(listen: tuple[str, int], target: tuple[str, int], echo: tuple[str, int],
                 delay_ms: float) -> None:
    relay = Relay(delay_ms)
    front = await asyncio.start_server(lambda r, w: relay.handle(target, r, w), *listen)
    echo_back = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo_target = ("127.0.0.1", echo_back.sockets[0].getsockname()[1])
    echo_front = await asyncio.start_server(lambda r, w: relay.handle(echo_target, r, w), *echo)
    print(f"READY {front.sockets[0].getsockname()[1]} {echo_front.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        words = line.decode().split()
        if len(words) == 2 and words[0] == "delay":
            relay.delay_s = float(words[1]) / 1000.0
            print(f"OK delay {words[1]}", flush=True)
        elif words:
            print(f"ERR unknown command {line.decode().strip()!r}", flush=True)
    for server in (front, echo_back, echo_front):
        server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any free port)")
    parser.add_argument("--target", required=True, help="HOST:PORT to relay to (the worker)")
    parser.add_argument("--echo", required=True, help="HOST:PORT of the delayed echo port (0: any)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per chunk, ms")
    args = parser.parse_args(argv)
    asyncio.run(_serve(_addr(args.listen), _addr(args.target), _addr(args.echo), args.delay_ms))


if __name__ == "__main__":
    main()
