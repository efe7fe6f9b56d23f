"""An HTTP proxy for fault tests of storage clients against a real endpoint (e.g. moto's
S3 server): it fails a share of requests (500/503 answers and connection resets), adds
latency, holds chosen requests (a download half-way, an upload before it is sent), goes
down for a while (:meth:`FlakyProxy.outage`: every connection reset), refuses a burst of
requests to one object (:meth:`FlakyProxy.fail_next`), and records every request.

Loopback only; deterministic given its seed.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many concurrent readers connect at once


class FlakyProxy:
    """Forward to ``upstream`` (``host:port``); fail ``failure_rate`` of the requests and
    delay each by ``latency_s`` before forwarding.

    Failures alternate between an HTTP 500/503 answer and a reset connection. ``counts``
    has how many requests were forwarded and how many failed; ``requests`` counts them
    per ``(method, path)``, ``held`` counts those a :meth:`stall` is holding or held,
    ``arrivals`` has ``(time.monotonic(), method, path)`` of each request as it came in, and
    ``spans`` has the (start, end) of each forwarded GET.
    """

    HOLD_S = 120.0

    def __init__(self, upstream: str, failure_rate: float = 0.0, *, seed: int = 0, latency_s: float = 0.0) -> None:
        self.upstream = upstream
        self.failure_rate = failure_rate
        self.latency_s = latency_s
        self.counts = {"forwarded": 0, "failed": 0}
        self.requests: Counter = Counter()
        self.held: Counter = Counter()
        self.arrivals: list[tuple[float, str, str]] = []
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self._stall: tuple[str, tuple[str, ...], bool] | None = None
        self._down_until = 0.0  # time.monotonic() until which every request is reset
        self._fail_next: tuple[str, int] = ("", 0)  # (path part, how many more): answered 503
        self._release = threading.Event()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self.endpoint = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # ---- test controls ------------------------------------------------------------------

    def stall(self, match: str, *, methods: tuple[str, ...] = ("GET",), exact: bool = False) -> None:
        """Hold requests of ``methods`` whose path contains ``match`` (is ``match``, when
        ``exact``: ``/bucket`` alone is a listing of the bucket) until :meth:`release`
        (at most ``HOLD_S``): a GET answer stops after its first quarter (a downloader
        killed mid-file), other requests are held before they are forwarded (an upload
        in flight when its uploader dies)."""
        self._release.clear()
        self._stall = (match, tuple(m.upper() for m in methods), exact)

    def fail_next(self, match: str, times: int) -> None:
        """Answer 503 (SlowDown) to the next ``times`` requests, of any method, whose path
        contains ``match``: a burst of refusals on one object."""
        with self._lock:
            self._fail_next = (match, times)

    def outage(self, seconds: float) -> None:
        """Reset every connection for the next ``seconds`` (the endpoint is down), from now."""
        self._down_until = time.monotonic() + seconds

    def release(self) -> None:
        """Finish held requests and stop holding."""
        self._stall = None
        self._release.set()

    def gets(self, suffix: str = "") -> dict[str, int]:
        """GETs per path ending in ``suffix``."""
        with self._lock:  # the relay's threads add keys
            return {p: n for (m, p), n in self.requests.items() if m == "GET" and p.endswith(suffix)}

    def count(self, suffix: str, methods: tuple[str, ...]) -> int:
        """Requests of ``methods`` to a path ending in ``suffix``."""
        with self._lock:
            return sum(n for (m, p), n in self.requests.items() if m in methods and p.endswith(suffix))

    def holding(self, suffix: str) -> int:
        """Requests to a path ending in ``suffix`` that a :meth:`stall` holds or held."""
        with self._lock:
            return sum(n for (_, p), n in self.held.items() if p.endswith(suffix))

    def holding_in(self, match: str) -> int:
        """Requests to a path that contains ``match`` that a :meth:`stall` holds or held."""
        with self._lock:
            return sum(n for (_, p), n in self.held.items() if match in p)

    def sequential_gets(self, path: str) -> int:
        """GETs of ``path`` that began after an earlier GET of it had been answered: a
        second download. (A client's retry of a request that timed out while the first
        was still in flight overlaps it and is not one.)"""
        spans = sorted(self.spans.get(path, []))
        return sum(1 for prev, cur in zip(spans, spans[1:]) if cur[0] >= prev[1])

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    # ---- the relay ----------------------------------------------------------------------

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests[(method, path)] += 1
            self.arrivals.append((time.monotonic(), method, path))
            if time.monotonic() < self._down_until:
                self.counts["failed"] += 1
                return "reset"
            match, left = self._fail_next
            if left > 0 and match in path:
                self._fail_next = (match, left - 1)
                self.counts["failed"] += 1
                return "503"
            if self._rng.random() >= self.failure_rate:
                self.counts["forwarded"] += 1
                return None
            self.counts["failed"] += 1
            return self._rng.choice(["500", "503", "reset"])

    def _forward(self, method: str, target: str, headers: dict, body: bytes):
        time.sleep(self.latency_s)
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _stalls(self, method: str, path: str) -> bool:
        stall = self._stall
        if stall is None or method not in stall[1]:
            return False
        return path == stall[0] if stall[2] else stall[0] in path

    def _hold(self, method: str, path: str) -> None:
        with self._lock:
            self.held[(method, path)] += 1
        self._release.wait(self.HOLD_S)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"proxy": self})


class _Handler(BaseHTTPRequestHandler):
    """One request through the proxy; ``proxy``: set on the subclass each proxy makes."""

    proxy: FlakyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _fail(self, failure: str) -> None:
        if failure == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            self.connection.close()
            self.close_connection = True
            return
        code = b"SlowDown" if failure == "503" else b"InternalError"
        msg = (
            b""
            if self.command == "HEAD"
            # a HEAD answer has no body
            else (b"<Error><Code>" + code + b"</Code><Message>injected</Message></Error>")
        )
        self.send_response(int(failure))
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self.wfile.write(msg)

    def _relay(self) -> None:
        body = self._body()
        path = self.path.split("?")[0]
        failure = self.proxy._decide(self.command, path)  # noqa: SLF001 - the proxy's own handler class
        if failure:
            self._fail(failure)
            return
        began = time.monotonic()
        if self.command != "GET" and self.proxy._stalls(self.command, path):  # noqa: SLF001 - the proxy's own handler class
            self.proxy._hold(self.command, path)  # noqa: SLF001 - the proxy's own handler class
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "content-length"}
        headers["Content-Length"] = str(len(body))
        status, resp_headers, data = self.proxy._forward(self.command, self.path, headers, body)  # noqa: SLF001 - the proxy's own handler class
        self.send_response(status)
        for k, v in resp_headers:
            if k.lower() not in _HOP and k.lower() != "content-length":
                self.send_header(k, v)
        # A HEAD answer keeps the upstream length (of the object it describes).
        length = dict((k.lower(), v) for k, v in resp_headers).get("content-length", "0")
        self.send_header("Content-Length", length if self.command == "HEAD" else str(len(data)))
        # One request per connection: with keep-alive, a client that timed out (a few
        # seconds under load) was seen reading the late answer as the next one's body.
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self._send(path, data)
        if self.command == "GET":
            self.proxy.spans.setdefault(path, []).append((began, time.monotonic()))

    def _send(self, path: str, data: bytes) -> None:
        if self.command == "GET" and self.proxy._stalls(self.command, path):  # noqa: SLF001 - the proxy's own handler class
            self.wfile.write(data[: len(data) // 4])
            self.wfile.flush()
            self.proxy._hold(self.command, path)  # noqa: SLF001 - the proxy's own handler class
            data = data[len(data) // 4 :]
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay
