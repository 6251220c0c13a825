"""A light HTTP load generator: N keep-alive connections, each polling status routes in a loop.

Run as its own process by :mod:`bench.polling`, so its CPU is not the server's or the driver's:

    python -m bench.pollers --url http://127.0.0.1:8000 --clients 200 --interval 0.2 \
        --seconds 20 --path /jobs/ID --path /concepts/NAME

Each client sends one request, reads the whole answer, sleeps ``interval`` seconds (the think time
of a client polling a job), and goes on with the next path, for ``seconds``. Raw asyncio streams
(HTTP/1.1 keep-alive), because an HTTP client library would use more CPU than the server on this
2-core machine. Prints one JSON object: requests, errors by kind, throughput and latency quantiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from urllib.parse import urlparse


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str) -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
    await reader.readexactly(length)
    return status


async def _client(
    url: str, paths: list[str], interval: float, until: float, offset: int, latencies: list[float], errors: Counter[str]
) -> None:
    parsed = urlparse(url)
    host = parsed.netloc
    reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
    turn = offset
    try:
        while time.monotonic() < until:
            path = paths[turn % len(paths)]
            turn += 1
            started = time.perf_counter()
            try:
                status = await asyncio.wait_for(_request(reader, writer, host, path), timeout=30)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                errors[type(exc).__name__] += 1
                writer.close()
                reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
                continue
            latencies.append(time.perf_counter() - started)
            if status >= 400:
                errors[f"HTTP {status}"] += 1
            await asyncio.sleep(interval)
    finally:
        writer.close()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(url: str, paths: list[str], clients: int, interval: float, seconds: float) -> dict[str, object]:
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(*(_client(url, paths, interval, until, i, latencies, errors) for i in range(clients)))
    elapsed = time.monotonic() - started
    return {
        "clients": clients,
        "interval_s": interval,
        "seconds": round(elapsed, 2),
        "requests": len(latencies),
        "errors": dict(errors),
        "throughput_rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * quantile(latencies, 0.50), 2),
        "p99_ms": round(1000 * quantile(latencies, 0.99), 2),
        "max_ms": round(1000 * max(latencies, default=float("nan")), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", action="append", required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.url, args.path, args.clients, args.interval, args.seconds))))  # noqa: T201


if __name__ == "__main__":
    main()
