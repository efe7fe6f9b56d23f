"""An HTTP proxy that fails a share of requests: 500/503 answers and connection resets.

For fault tests of storage clients against a real endpoint (e.g. moto's S3 server).
Loopback only; deterministic given its seed.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FlakyProxy:
    """Forward to ``upstream`` (``host:port``); fail ``failure_rate`` of the requests.

    Failures alternate between an HTTP 500/503 answer and a reset connection. ``counts``
    has how many requests were forwarded and how many failed.
    """

    def __init__(self, upstream: str, failure_rate: float, *, seed: int = 0) -> None:
        self.upstream = upstream
        self.failure_rate = failure_rate
        self.counts = {"forwarded": 0, "failed": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _decide(self) -> str | None:
        with self._lock:
            if self._rng.random() >= self.failure_rate:
                self.counts["forwarded"] += 1
                return None
            self.counts["failed"] += 1
            return self._rng.choice(["500", "503", "reset"])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
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

            def _relay(self) -> None:
                body = self._body()
                failure = proxy._decide()
                if failure == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                    self.connection.close()
                    self.close_connection = True
                    return
                if failure:
                    msg = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    if failure == "503":
                        msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    if self.command == "HEAD":
                        msg = b""  # a HEAD answer has no body
                    self.send_response(int(failure))
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP and k.lower() != "content-length"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                # A HEAD answer keeps the upstream length (of the object it describes).
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else len(data)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
