"""A TCP proxy on loopback that adds a fixed latency to everything a client sends to a server.

Every chunk read from a client is forwarded to the upstream server ``delay`` seconds after it
arrived, in order but not serialized (chunks in flight overlap, as on a link with that one-way
latency); replies flow back undelayed. An HTTP request therefore reaches the server at least
``delay`` after it was sent, on new and on kept-alive connections alike, and every
request/response round trip costs at least ``delay`` more. Accepting a connection is not delayed.

    python benchmarks/latency_proxy.py --upstream-port 8333 --delay-ms 20

prints ``listening on <port>`` once it accepts connections, and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import time

LOOPBACK = "127.0.0.1"
_CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it arrived; then close."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def forward() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(forward())
    try:
        while data := await reader.read(_CHUNK):
            queue.put_nowait((time.monotonic() + delay, data))
        queue.put_nowait((0.0, b""))
        await sender
    except ConnectionError:
        pass  # a peer went away: closing this side tells the other one
    finally:
        sender.cancel()
        writer.close()


async def _serve_connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter,
                            upstream_port: int, delay: float) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(LOOPBACK, upstream_port)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(_pipe(client_reader, server_writer, delay), _pipe(server_reader, client_writer, 0.0),
                         return_exceptions=True)


async def serve(port: int, upstream_port: int, delay: float) -> None:
    """Listen on 127.0.0.1:``port`` (0: any free port), proxying to 127.0.0.1:``upstream_port``."""
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, upstream_port, delay), LOOPBACK, port, backlog=1024)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    parser.add_argument("--upstream-port", type=int, required=True, help="the server's port on 127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added client->server latency (default 20)")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.upstream_port, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
