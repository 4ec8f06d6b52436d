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

Thread-safety: plain functions on the caller's socket and reader.
"""

from __future__ import annotations

import http.client
from collections.abc import Mapping
from typing import BinaryIO

from cachefs.errors import StoreError

_MAX_LINE = 65536
_MAX_HEADERS = 100


def send(sock: object, method: str, target: str, headers: Mapping[str, str]) -> None:
    """Send the request line and headers (no body). Raises OSError, StoreError for a
    header value that would break the request."""
    parts = [f"{method} {target} HTTP/1.1\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise StoreError(f"refusing to send header {name!r}: it contains a line break")
        parts.append(f"{name}: {value}\r\n")
    parts.append("Accept-Encoding: identity\r\n\r\n")
    sock.sendall("".join(parts).encode("latin-1"))  # type: ignore[attr-defined]


def _line(fp: BinaryIO) -> bytes:
    line = fp.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise http.client.LineTooLong("header line")
    return line


def read_answer(fp: BinaryIO, method: str, wanted: tuple[str, ...] = ()
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


def _chunked(fp: BinaryIO) -> bytes:
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
