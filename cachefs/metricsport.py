"""The metrics port: the page Prometheus scrapes, served so no client can hold it up.

The port has no access control (as Prometheus endpoints go): any process that can reach
it may connect, send its request a byte at a time, or never send it. So the page is
served in two stages, and neither lets one client keep it from another:

* **Requests are read by one thread for every connection at once** (``cachefs-metrics``,
  a selector over non-blocking sockets). A connection costs a buffer of at most
  :data:`MAX_REQUEST` bytes, no thread; it is closed :data:`REQUEST_DEADLINE` seconds
  after its accept if its request has not been read whole by then. At most
  :data:`MAX_READING` connections are read at a time: beyond that the one accepted first
  is closed (a scraper sends its request at once, so it is the oldest only if it
  stalls). The listen queue is drained at every wake-up, so a scrape never waits behind
  connections that others hold open.
* **Complete requests are answered by :data:`SCRAPERS` threads** (``cachefs-scrape``),
  which render the page (prometheus_client's WSGI app: the text or OpenMetrics format,
  gzip, ``name[]`` filters) and send it, each connection cut off
  :data:`ANSWER_DEADLINE` seconds after its request was read (a client that does not
  read its page holds a thread that long at most). The queue of complete requests holds
  :data:`ANSWER_QUEUE`; a request beyond that is answered 503 at once (the page is a
  few milliseconds of work: only a flood fills the queue).

Every answer closes its connection (``Connection: close``): Prometheus opens a new one per
scrape when it must. Nothing here touches the trio thread; the threads are daemon threads
that live as long as the process (the page is served until the daemon exits).
"""

from __future__ import annotations

import errno
import io
import logging
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from prometheus_client import make_wsgi_app

from cachefs.errors import ConfigError
from cachefs.metrics import EXPOSED, parse_metrics_addr

log = logging.getLogger(__name__)

#: Seconds from a connection's accept until its request must have been read whole.
REQUEST_DEADLINE = 5.0
#: Seconds from a request read until its answer must have been sent.
ANSWER_DEADLINE = 5.0
#: Connections whose requests are being read at once; more close the oldest.
MAX_READING = 256
#: The longest request (request line and headers) read; a longer one is answered 431.
MAX_REQUEST = 32 * 1024
#: Threads that render and send pages.
SCRAPERS = 2
#: Complete requests waiting for a scraper thread; more are answered 503.
ANSWER_QUEUE = 32
#: The kernel's listen queue (connections not yet accepted; drained at every wake-up).
BACKLOG = 128
#: Seconds the reader rests when it cannot accept for want of descriptors.
ACCEPT_REST = 0.1

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Reading:
    """A connection whose request is being read (the reader thread's only)."""

    __slots__ = ("buffer", "deadline", "peer", "sock")

    def __init__(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.buffer = bytearray()
        self.deadline = deadline


class MetricsPort:
    """Serves ``app`` on a bound, listening socket (see the module docstring)."""

    def __init__(self, listener: socket.socket, app: WsgiApp) -> None:
        self.listener = listener
        self.app = app
        host, port = listener.getsockname()[:2]
        self.address = (str(host), int(port))
        self._reading: dict[int, _Reading] = {}  # by descriptor, in order of accept
        self._answers: queue.Queue[tuple[socket.socket, bytes]] = queue.Queue(ANSWER_QUEUE)
        self._selector = selectors.DefaultSelector()
        self._accept_failing = False  # (the reader thread's: an accept failed for descriptors)

    def start(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        threading.Thread(target=self._read_requests, name="cachefs-metrics",
                         daemon=True).start()
        for _ in range(SCRAPERS):
            threading.Thread(target=self._answer_requests, name="cachefs-scrape",
                             daemon=True).start()

    # -- the reader thread ------------------------------------------------------------------
    def _read_requests(self) -> None:
        while True:
            try:
                self._read_once()
            except Exception:  # a bug must not end the page for the daemon's life
                log.exception("metrics: reading requests failed")
                time.sleep(1)

    def _read_once(self) -> None:
        timeout = None
        if self._reading:
            oldest = next(iter(self._reading.values()))
            timeout = max(0.0, oldest.deadline - time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept_all()
            else:
                self._receive(key.fd)
        now = time.monotonic()
        while self._reading:
            oldest = next(iter(self._reading.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest)  # too slow: cut off

    def _accept_all(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the waiting connections stay queued. The
                    # listener stays readable, so the thread rests before it looks again
                    # (it would spin on a core otherwise); other clients wait that long.
                    if not self._accept_failing:  # (one line per episode, not ten a second)
                        log.warning("metrics: cannot accept connections: %s", exc.strerror)
                    self._accept_failing = True
                    time.sleep(ACCEPT_REST)
                    return
                continue  # (the client went away before its accept)
            if self._accept_failing:
                log.info("metrics: accepting connections again")
                self._accept_failing = False
            if len(self._reading) >= MAX_READING:
                self._drop(next(iter(self._reading.values())))
            sock.setblocking(False)
            conn = _Reading(sock, peer, time.monotonic() + REQUEST_DEADLINE)
            self._reading[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _receive(self, fd: int) -> None:
        conn = self._reading.get(fd)
        if conn is None:
            return
        try:
            data = conn.sock.recv(MAX_REQUEST + 1 - len(conn.buffer))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # (reset: the client's own business)
        if not data:
            self._drop(conn)
            return
        conn.buffer += data
        end = conn.buffer.find(b"\r\n\r\n")
        if end < 0:
            end = conn.buffer.find(b"\n\n")
        if end < 0 and len(conn.buffer) <= MAX_REQUEST:
            return  # (more to come)
        self._forget(conn)
        if end < 0:
            _send_now(conn.sock, _short_answer("431 Request Header Fields Too Large"))
            return
        try:
            self._answers.put_nowait((conn.sock, bytes(conn.buffer[:end])))
        except queue.Full:
            _send_now(conn.sock, _short_answer("503 Service Unavailable"))

    def _forget(self, conn: _Reading) -> None:
        del self._reading[conn.sock.fileno()]
        self._selector.unregister(conn.sock)

    def _drop(self, conn: _Reading) -> None:
        self._forget(conn)
        conn.sock.close()

    # -- the scraper threads ----------------------------------------------------------------
    def _answer_requests(self) -> None:
        while True:
            sock, request = self._answers.get()
            timer = threading.Timer(ANSWER_DEADLINE, _cut_off, (sock,))
            timer.daemon = True
            timer.start()
            try:
                sock.setblocking(True)
                sock.settimeout(ANSWER_DEADLINE)
                sock.sendall(self._render(request))
            except OSError:
                pass  # (the client went away or was cut off: its own business)
            except Exception:
                log.warning("metrics: answering a scrape failed", exc_info=True)
            finally:
                timer.cancel()
                sock.close()

    def _render(self, request: bytes) -> bytes:
        """The whole answer to ``request`` (its request line and headers)."""
        lines = request.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _short_answer("400 Bad Request")
        method, target, _ = parts
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query,
            "SERVER_NAME": self.address[0], "SERVER_PORT": str(self.address[1]),
            "SERVER_PROTOCOL": "HTTP/1.1", "SCRIPT_NAME": "", "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                key = "HTTP_" + name.strip().upper().replace("-", "_")
                environ.setdefault(key, value.strip())
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> None:
            answer[:] = [status, headers]

        body = b"".join(self.app(environ, start_response))
        status, headers = answer
        head = [f"HTTP/1.1 {status}"]
        head += [f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length",
                                                                      "connection")]
        head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        return "\r\n".join(head).encode("latin-1") + (b"" if method == "HEAD" else body)


def _short_answer(status: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .encode("latin-1"))


def _send_now(sock: socket.socket, answer: bytes) -> None:
    """Send a short answer without waiting (what does not fit is the client's loss), then
    close: what the client sent beyond its request and has arrived by now is read first,
    since closing with unread bytes resets the connection, and the client may lose the
    answer (a reset discards what it has not read yet)."""
    try:
        sock.send(answer)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not sock.recv(65536):
                break
    except OSError:
        pass  # (nothing more has arrived, or the client went away)
    sock.close()


def _cut_off(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # (ends a send blocked in the scraper thread)
    except OSError:
        pass  # (gone already)


def serve_metrics(addr: str, app: WsgiApp | None = None) -> tuple[str, int]:
    """Serve ``app`` (by default the page of :data:`cachefs.metrics.EXPOSED`) on ``addr``
    (HOST:PORT, port 0 for one the kernel picks) from daemon threads; return the bound
    (host, port). Raises ConfigError (one clear line) when the address cannot be bound."""
    host, port = parse_metrics_addr(addr)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(BACKLOG)
        except BaseException:
            listener.close()
            raise
    except socket.gaierror as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {reason}") from None
    served = MetricsPort(listener, app if app is not None else make_wsgi_app(EXPOSED))
    served.start()
    return served.address
