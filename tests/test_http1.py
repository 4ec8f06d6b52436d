"""The S3 client's HTTP/1.1 wire (cachefs.s3.http1) on a real socket pair."""

from __future__ import annotations

import http.client
import io
import socket

import pytest

from cachefs.errors import StoreError
from cachefs.s3 import http1
from cachefs.s3.store import Exchange


@pytest.fixture(params=["socket", "buffered"], autouse=True)
def reader_kind(request: pytest.FixtureRequest) -> str:
    """Every answer is read by the client's SocketReader and by io.BufferedReader (the
    reader read_answer was first written for: the two must agree)."""
    kind: str = request.param
    _KIND[0] = kind
    return kind


_KIND = ["socket"]


def answer(raw: bytes, method: str = "GET", wanted: tuple[str, ...] = ()
           ) -> tuple[int, dict[str, str], bytes, bool]:
    """Read ``raw`` as the server's answer through a real socket."""
    client, server = socket.socketpair()
    with client, server:
        server.sendall(raw)
        server.shutdown(socket.SHUT_WR)
        if _KIND[0] == "socket":
            http1.set_idle_timeout(client, 5.0)
            return http1.read_answer(http1.SocketReader(client, Exchange(5.0), 5.0), method,
                                     wanted)
        fp = io.BufferedReader(client.makefile("rb", buffering=0))  # type: ignore[arg-type]
        try:
            return http1.read_answer(fp, method, wanted)
        finally:
            fp.close()


def test_a_request_is_sent_as_http_1_1_with_its_headers() -> None:
    client, server = socket.socketpair()
    with client, server:
        http1.send(client, "GET", "/b/k%20x?x=1", {"Host": "h:1", "If-Match": '"e"'})
        client.shutdown(socket.SHUT_WR)
        sent = b"".join(iter(lambda: server.recv(65536), b""))
    assert sent == (b'GET /b/k%20x?x=1 HTTP/1.1\r\nHost: h:1\r\nIf-Match: "e"\r\n'
                    b"Accept-Encoding: identity\r\n\r\n")


@pytest.mark.parametrize("value", ['"e"\r\nX-Injected: 1', "a\nb", "a\rb"])
def test_a_header_value_with_a_line_break_is_never_sent(value: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        with pytest.raises(StoreError, match="line break"):
            http1.send(client, "GET", "/b/k", {"If-Match": value})
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.recv(10)  # nothing was sent


def test_a_body_framed_by_content_length() -> None:
    status, headers, body, close = answer(
        b"HTTP/1.1 206 Partial Content\r\nETag: \"abc\"\r\nContent-Length: 5\r\n"
        b"X-Amz-Checksum-Crc64nvme: AAAA\r\n\r\nhello")
    assert (status, body, close) == (206, b"hello", False)
    assert headers["etag"] == '"abc"'
    assert headers["x-amz-checksum-crc64nvme"] == "AAAA"


def test_only_wanted_headers_are_returned() -> None:
    _, headers, _, _ = answer(b"HTTP/1.1 200 OK\r\nETag: e\r\nServer: x\r\nX-Amz-Checksum-Crc32: q"
                              b"\r\nContent-Length: 0\r\n\r\n", wanted=("etag", "x-amz-checksum"))
    assert headers == {"etag": "e", "x-amz-checksum-crc32": "q"}


def test_a_chunked_body_with_extensions_and_trailers() -> None:
    status, _, body, close = answer(
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\n<Erro\r\n0b\r\nr>NoSuchKey\r\n0\r\nX-Trailer: t\r\n\r\n")
    assert (status, body, close) == (404, b"<Error>NoSuchKey", False)


def test_a_body_framed_by_the_end_of_the_connection() -> None:
    status, _, body, close = answer(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
    assert (status, body, close) == (200, b"until the end", True)


def test_head_and_304_answers_have_no_body() -> None:
    assert answer(b"HTTP/1.1 200 OK\r\nContent-Length: 110000\r\n\r\n", "HEAD")[2] == b""
    assert answer(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n")[2] == b""


def test_interim_answers_are_skipped() -> None:
    status, _, body, _ = answer(b"HTTP/1.1 100 Continue\r\n\r\n"
                                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert (status, body) == (200, b"ok")


@pytest.mark.parametrize("raw,close", [
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n", False),
])
def test_the_connection_closes_when_the_answer_says_so(raw: bytes, close: bool) -> None:
    assert answer(raw)[3] is close


def test_folded_and_repeated_headers() -> None:
    _, headers, _, _ = answer(b"HTTP/1.1 200 OK\r\nETag: first\r\nX-Long: a\r\n  b\r\n"
                              b"ETag: second\r\nContent-Length: 0\r\n\r\n")
    assert headers["etag"] == "first"
    assert headers["x-long"] == "a b"


def test_a_short_body_is_an_incomplete_read() -> None:
    with pytest.raises(http.client.IncompleteRead):
        answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
    with pytest.raises(http.client.IncompleteRead):
        answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nshort")


def test_a_closed_connection_without_an_answer() -> None:
    with pytest.raises(http.client.RemoteDisconnected):
        answer(b"")


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH\r\n\r\n",
    b"HTTP/1.1 abc OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",
])
def test_malformed_answers_raise_http_exceptions(raw: bytes) -> None:
    with pytest.raises(http.client.HTTPException):
        answer(raw)

