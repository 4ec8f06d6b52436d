"""A fault-injecting HTTP proxy for S3 tests (loopback only).

Forwards every request to the upstream S3 server, except where the current
``plan`` says otherwise: answer ``503 SlowDown``, reset the connection, or
stall. Counts requests by method so tests can assert what reached S3.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")

# A plan maps (method, path, request number) -> "pass" | "503" | "reset" | "stall" | "down".
Plan = Callable[[str, str, int], str]


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.plan: Plan = lambda method, path, n: "pass"
        self.counts: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._n = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                with proxy._lock:
                    proxy._n += 1
                    n = proxy._n
                action = proxy.plan(self.command, self.path, n)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if action != "pass":
                    proxy.faults[action] += 1
                if action == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if action in ("reset", "down"):
                    # SO_LINGER 0 makes close() send RST: a connection reset by peer.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if action == "stall":
                    time.sleep(60)
                    return
                proxy.counts[self.command] += 1
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 128  # the default 5 drops connections of busy clients

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
