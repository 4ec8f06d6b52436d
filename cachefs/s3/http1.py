"""One HTTP/1.1 request and its answer on a connected socket: the S3 client's wire.

:mod:`cachefs.s3.ranges` connects with ``http.client`` (TLS, proxy tunnels)
but sends requests and reads answers here. ``http.client``'s response object
parses every answer's headers with the ``email`` package (~28 us of a small
GET's CPU on this project's machines, against ~4 us here), and its request
object validates each header with regular expressions; cold small files make
one GET each, and the daemon's CPU per file bounds their throughput.

What is supported is what S3 and S3-compatible servers answer a GET, HEAD or
listing with: a status line (``HTTP/1.x``), interim ``1xx`` answers skipped,
headers (obsolete folded lines joined; the first of repeated names kept),
and a body framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or
the end of the connection; no body for HEAD, 204 and 304. Malformed answers
raise ``http.client`` exceptions (``BadStatusLine``, ``LineTooLong``,
``IncompleteRead``; a connection closed before any answer raises
``RemoteDisconnected``), so callers handle them as before. Header values are
checked for CR/LF before anything is sent (no header injection from an ETag
a server made up).

Answers are read from the socket by :class:`SocketReader`: the status line and
headers from one recv() of up to 16 KiB, a body of stated length with as few
recv() calls as the kernel allows. On a plain TCP socket the descriptor is
blocking and each recv() of a body asks for all the bytes still due
(``MSG_WAITALL``): the kernel copies the segments as they arrive and returns
to Python once, instead of once per segment (with Python's socket timeout the
descriptor is non-blocking and every segment costs a poll(), a recv(), a Python
call and an interpreter-lock hand-over; on a long-distance link a 110 KB body
arrives in dozens of segments). ``SO_RCVLOWAT`` is not raised to the body's
length, though it would spare the kernel's wake-up per segment: a wait whose
remaining bytes are fewer than the low-water mark sleeps past their arrival
(measured: +5 ms per 110 KB answer, and shard reads at 54-64% of the link
instead of 84%). ``SO_RCVTIMEO`` bounds each wait to :data:`SLICE`, so the
progress of a slow body is still reported at least that often (see
:func:`set_idle_timeout` for the idle-timeout contract), and a shutdown of the
socket from another thread (an aborted request) wakes a waiting recv() at once.
TLS sockets cannot be asked for ``MSG_WAITALL``: they keep Python's socket
timeout, and each recv() returns what one TLS record holds. A body of
:data:`IN_PLACE_BODY` bytes or more is received into one ``bytearray`` of its
size and returned as it is (bytes-like, never changed after): joined from parts,
a large body costs a second buffer whose every page faults.

A GET on a plain socket is exchanged by :func:`exchange_plain`: where the C
extension is built (``_wire.c``), the request sent, the head read and parsed,
a body of the expected Content-Length received straight into the bytes object
returned, and its MD5 computed when it will be checked, all in one call that
releases the interpreter lock once (in Python that lock is given up and taken
again for each send, recv and hash: under a few hundred GETs in flight, two
thread switches a time). Any answer that is not that plain case goes on in
:func:`read_answer` from the bytes the call received, so every other answer is
judged by the one parser here.

Thread-safety: plain functions on the caller's socket and reader; one
:class:`SocketReader` belongs to the thread that reads one answer.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import struct
import time
from collections.abc import Mapping
from typing import Protocol

from cachefs.errors import StoreError

try:  # one GET's exchange in one call, one release of the interpreter lock (see _wire.c)
    from cachefs.s3 import _wire
except ImportError:  # built without extensions (no compiler or libcrypto at install time)
    _wire = None  # type: ignore[assignment]

#: Whether :func:`exchange_plain` runs in C (else it is :func:`send` and :func:`read_answer`).
NATIVE_EXCHANGE = _wire is not None

_MAX_LINE = 65536
_MAX_HEADERS = 100
_HEAD_READ = 16384  # one recv() for the status line and headers (S3's are < 1 KiB)
#: A body of at least this many bytes is received in place into one buffer of its size
#: (see :meth:`SocketReader.read`).
IN_PLACE_BODY = 1 << 20
#: Longest single wait of a blocking recv() on a plain socket, in seconds: progress
#: reports of a slow body are at most this old, and the idle timeout may overrun by it.
SLICE = 0.25


class Reader(Protocol):
    """What :func:`read_answer` reads from (``io.BufferedReader`` or :class:`SocketReader`)."""

    def readline(self, limit: int = -1, /) -> bytes: ...

    def read(self, n: int = -1, /) -> bytes: ...


class Progress(Protocol):
    """Where a reader reports arrivals (:class:`cachefs.s3.store.Exchange`)."""

    progress_at: float

    def received(self) -> None: ...

    def reached(self, first_at: float, last_at: float) -> None: ...


def set_idle_timeout(sock: socket.socket, idle: float) -> None:
    """Make ``sock`` end a request after ``idle`` seconds without a byte (sending or
    receiving); a slow but progressing answer is never ended.

    A TLS socket gets Python's socket timeout (every wait is bounded by ``idle``). A
    plain socket is made blocking with ``SO_RCVTIMEO`` = min(idle, :data:`SLICE`) and
    ``SO_SNDTIMEO`` = idle: :class:`SocketReader` waits again after a slice that
    brought nothing until ``idle`` has passed since the last arrival (so the silence
    tolerated is ``idle`` plus at most one slice). Raises OSError."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(idle)
        return
    sock.settimeout(None)  # a blocking descriptor: recv() waits in the kernel
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(idle, SLICE)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(idle))


def _timeval(seconds: float) -> bytes:
    usec = max(1000, round(seconds * 1e6))  # never 0: a zero SO_RCVTIMEO waits forever
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


class SocketReader:
    """The file-like reads :func:`read_answer` makes, straight from a socket prepared by
    :func:`set_idle_timeout`, reporting each arrival to ``progress``.

    ``readline`` serves the status line and headers from a buffer filled by recv()s of
    up to 16 KiB; ``read(n)`` takes what the buffer holds and asks the socket for the
    rest at once (``MSG_WAITALL`` on a plain socket). Raises OSError (TimeoutError once
    ``idle`` seconds passed without a byte)."""

    __slots__ = ("_buf", "_flags", "_idle", "_plain", "_pos", "_progress", "_sock")

    def __init__(self, sock: socket.socket, progress: Progress, idle: float,
                 received: bytes = b"") -> None:
        self._sock = sock
        self._progress = progress
        self._idle = idle
        self._plain = not isinstance(sock, ssl.SSLSocket)
        self._flags = socket.MSG_WAITALL if self._plain else 0
        self._buf = received  # (bytes of the answer read already: exchange_plain's)
        self._pos = 0

    def _recv(self, n: int, flags: int) -> bytes:
        """Up to ``n`` bytes (b"" at the end of the stream)."""
        while True:
            try:
                data = self._sock.recv(n, flags)
            except BlockingIOError:  # a plain socket's slice passed without a byte
                self._check_silence()
                continue
            if data:
                self._progress.received()
            return data

    def _check_silence(self) -> None:
        """A wait (one SO_RCVTIMEO slice) brought nothing: TimeoutError once ``idle``
        seconds passed since the last arrival."""
        silent = time.monotonic() - self._progress.progress_at
        if silent >= self._idle:
            raise TimeoutError(f"no byte for {silent:.1f} s") from None

    def _recv_into(self, view: memoryview, flags: int) -> int:
        """:meth:`_recv` into ``view``; the number of bytes (0 at the end of the stream)."""
        while True:
            try:
                n = self._sock.recv_into(view, len(view), flags)
            except BlockingIOError:
                self._check_silence()
                continue
            if n:
                self._progress.received()
            return n

    def readline(self, limit: int = -1, /) -> bytes:
        limit = _MAX_LINE + 1 if limit < 0 else limit
        while True:
            buf, pos = self._buf, self._pos
            end = buf.find(b"\n", pos, pos + limit)
            if end >= 0:
                self._pos = end + 1
                return buf[pos:end + 1]
            if len(buf) - pos >= limit:
                self._pos = pos + limit
                return buf[pos:pos + limit]
            data = self._recv(_HEAD_READ, 0)
            if not data:
                self._buf, self._pos = b"", 0
                return buf[pos:]
            self._buf, self._pos = buf[pos:] + data, 0

    def read(self, n: int = -1, /) -> bytes:
        buf, pos = self._buf, self._pos
        if n < 0:  # to the end of the stream
            parts = [buf[pos:]]
            while data := self._recv(65536, 0):
                parts.append(data)
            self._buf, self._pos = b"", 0
            return b"".join(parts)
        have = len(buf) - pos
        if have >= n:
            self._pos = pos + n
            return buf[pos:pos + n]
        self._buf, self._pos = b"", 0
        if n >= IN_PLACE_BODY:
            return self._read_in_place(n, buf[pos:])
        parts = [buf[pos:]] if have else []
        need = n - have
        while need:
            data = self._recv(need, self._flags)
            if not data:
                break  # the stream ended: a short read, for the caller to judge
            parts.append(data)
            need -= len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_in_place(self, n: int, head: bytes) -> bytes:
        """``n`` bytes, the first of them ``head`` (already buffered), received into one
        ``bytearray`` of that size (returned as it is: bytes-like, and never changed
        after). A large body arrives in more than one recv() (the head's buffer holds its
        start; a slow link spans several slices): joining the parts copies it into fresh
        memory, which the allocator takes from and returns to the kernel each time, so
        every page faults -- 10 ms of system time per 4 MiB body on this project's
        machines, against ~2 ms received in place. Shorter when the stream ends early
        (for the caller to judge)."""
        out = bytearray(n)
        got = len(head)
        out[:got] = head
        with memoryview(out) as view:
            while got < n:
                k = self._recv_into(view[got:], self._flags)
                if not k:
                    break
                got += k
        if got < n:
            del out[got:]
        return out  # type: ignore[return-value]


def request(method: str, target: str, headers: Mapping[str, str]) -> bytes:
    """The request line and headers (no body), as sent. Raises StoreError for a header
    value that would break the request."""
    parts = [f"{method} {target} HTTP/1.1\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise StoreError(f"refusing to send header {name!r}: it contains a line break")
        parts.append(f"{name}: {value}\r\n")
    parts.append("Accept-Encoding: identity\r\n\r\n")
    return "".join(parts).encode("latin-1")


def send(sock: object, method: str, target: str, headers: Mapping[str, str]) -> None:
    """Send the request line and headers (no body). Raises OSError, StoreError for a
    header value that would break the request."""
    sock.sendall(request(method, target, headers))  # type: ignore[attr-defined]


def exchange_plain(sock: socket.socket, request: bytes, expect: int, progress: Progress,
                   idle: float, wanted: tuple[str, ...] = (), md5: bool = False,
                   pooled: bool = False
                   ) -> tuple[int, dict[str, str], bytes, bool, bytes | None] | None:
    """Send ``request`` (a GET: :func:`request`) on a plain socket prepared by
    :func:`set_idle_timeout` and read its answer, expected to carry ``expect`` (> 0)
    bytes: (status, headers, body, whether the connection must close, the body's MD5 or
    None) -- :func:`read_answer`'s results and errors exactly, for the same answers.
    With ``pooled`` (an idle kept-alive connection), None without sending anything if
    the socket is readable or failed (:func:`dropped`: the server closed it meanwhile).

    With the C extension (:data:`NATIVE_EXCHANGE`), the plain case -- a final answer
    whose Content-Length is ``expect``, its head well-formed -- is exchanged in one call
    with the interpreter lock released once (``_wire.c``): the head parsed there, the
    body received straight into the bytes returned and, with ``md5``, its MD5 computed
    when the answer is a 200 that states no full-object checksum (else None: the caller
    computes what it checks). Any other answer is read on from the bytes the call
    received by :func:`read_answer`. Progress is reported to ``progress`` at least once
    an SO_RCVTIMEO slice while the answer arrives (``Progress.reached``), the first
    arrival included: a waiter may see it up to one :data:`SLICE` late, never later.
    ``wanted``: as for :func:`read_answer`. Without the extension: :func:`send`
    and :func:`read_answer`, no MD5. Raises OSError and http.client.HTTPException."""
    if _wire is None:
        if pooled and dropped(sock):
            return None
        sock.sendall(request)
        status, headers, body, will_close = read_answer(
            SocketReader(sock, progress, idle), "GET", wanted)
        return status, headers, body, will_close, None
    answer = _wire.exchange(sock.fileno(), request, expect, idle, progress.progress_at,
                            wanted, md5, progress.reached, pooled)
    if not answer:
        return None
    if len(answer) == 1:
        status, headers, body, will_close = read_answer(
            SocketReader(sock, progress, idle, answer[0]), "GET", wanted)
        return status, headers, body, will_close, None
    status, headers, body, will_close, digest = answer
    if len(body) < expect:
        raise http.client.IncompleteRead(body, expect - len(body))
    return status, headers, body, will_close, digest


def dropped(sock: socket.socket) -> bool:
    """Whether an idle kept-alive connection's socket can no longer be sent on: readable
    while no answer is due (the server closed it, or sent something unasked), or failed.
    One poll of the socket, without waiting."""
    try:
        poller = select.poll()  # (not select(): descriptors above 1023 are refused there)
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _line(fp: Reader) -> bytes:
    line = fp.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise http.client.LineTooLong("header line")
    return line


def read_answer(fp: Reader, method: str, wanted: tuple[str, ...] = ()
                ) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers, body, whether the connection must close) of the next answer on
    ``fp``. ``headers``: names lower-cased, only those starting with one of ``wanted``
    (all when empty). Raises OSError and http.client.HTTPException."""
    while True:
        line = _line(fp)
        if not line:
            raise http.client.RemoteDisconnected("the server closed the connection "
                                                 "without an answer")
        version, _, rest = line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise http.client.BadStatusLine(repr(line[:100]))
        status = int(code)
        headers: dict[str, str] = {}
        last = ""
        for _ in range(_MAX_HEADERS + 1):
            line = _line(fp)
            if line in (b"\r\n", b"\n", b""):
                break
            if line[:1] in (b" ", b"\t") and last:  # an obsolete folded continuation
                headers[last] += " " + line.strip().decode("latin-1")
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise http.client.BadStatusLine(f"malformed header line {line[:100]!r}")
            last = name.strip().decode("latin-1").lower()
            if last not in headers:
                headers[last] = value.strip().decode("latin-1")
            else:
                last = ""  # a repeated name: the first is kept, its continuation ignored
        else:
            raise http.client.HTTPException(f"more than {_MAX_HEADERS} headers")
        if not 100 <= status < 200:
            break
    connection = headers.get("connection", "").lower()
    will_close = "close" in connection or (version == b"HTTP/1.0"
                                           and "keep-alive" not in connection)
    if method == "HEAD" or status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = _chunked(fp)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise http.client.HTTPException("bad Content-Length") from None
        if length < 0:
            raise http.client.HTTPException("bad Content-Length")
        body = fp.read(length) if length else b""
        if len(body) < length:
            raise http.client.IncompleteRead(body, length - len(body))
    else:
        body = fp.read()  # framed by the end of the connection
        will_close = True
    if wanted:
        headers = {k: v for k, v in headers.items() if k.startswith(wanted)}
    return status, headers, body, will_close


def _chunked(fp: Reader) -> bytes:
    parts: list[bytes] = []
    while True:
        line = _line(fp)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise http.client.IncompleteRead(b"".join(parts)) from None
        if size == 0:
            while _line(fp) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(parts)
        chunk = fp.read(size)
        if len(chunk) < size:
            raise http.client.IncompleteRead(b"".join(parts) + chunk, size - len(chunk))
        parts.append(chunk)
        fp.read(2)  # the CRLF after the chunk
