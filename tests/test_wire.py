"""One GET's exchange in one call (cachefs/s3/_wire.c, through http1.exchange_plain) on
real sockets: every answer read as http1.read_answer reads it, the body's MD5 computed on
the way only when it will be checked, and each fault of the wire -- a body cut short, a
reset, a stall past the idle timeout, an abort from another thread, altered bytes --
ending the exchange as it does on the Python path."""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from cachefs.errors import IntegrityError
from cachefs.s3 import http1, integrity
from cachefs.s3.boto import S3Store
from cachefs.s3.store import Exchange
from tests.conftest import send_slowly
from tests.faultproxy import FaultProxy

WANTED = ("etag", "x-amz-checksum", "x-amz-server-side-encryption")


@pytest.fixture(params=["native", "python"])
def wire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each exchange path: the C one and Python's (an install built without it)."""
    if request.param == "python":
        monkeypatch.setattr(http1, "_wire", None)
    elif not http1.NATIVE_EXCHANGE:
        assert not os.environ.get("CI"), "the exchange extension was not built"
        pytest.skip("built without the exchange extension")
    return str(request.param)


def _exchange(client: socket.socket, idle: float = 5.0, expect: int = 0, md5: bool = True,
              wanted: tuple[str, ...] = WANTED) -> tuple[Any, Exchange]:
    exchange = Exchange(idle)
    http1.set_idle_timeout(client, idle)
    exchange.sending()
    got = http1.exchange_plain(client, b"GET /b/k HTTP/1.1\r\n\r\n", expect, exchange, idle,
                               wanted, md5)
    return got, exchange


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # (compared by type and text)
        return type(exc), str(exc)


def _as_read_answer_reads(raw: bytes, expect: int, wanted: tuple[str, ...]) -> Any:
    client, server = socket.socketpair()
    with client, server:
        server.sendall(raw)
        server.shutdown(socket.SHUT_WR)
        http1.set_idle_timeout(client, 5.0)
        return _outcome(lambda: http1.read_answer(
            http1.SocketReader(client, Exchange(5.0), 5.0), "GET", wanted))


def _as_exchanged(raw: bytes, expect: int, wanted: tuple[str, ...]) -> Any:
    client, server = socket.socketpair()
    with client, server:
        server.sendall(raw)
        server.shutdown(socket.SHUT_WR)
        got = _outcome(lambda: _exchange(client, expect=expect, wanted=wanted)[0])
        return got[:4] if len(got) == 5 else got  # (less the MD5)


BODY = bytes(range(256)) * 40  # 10,240 bytes
N = len(BODY)
ANSWERS = {
    "plain": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nETag: \"e\"\r\n\r\n" % N + BODY,
    "names and values in any case and spacing": (
        b"HTTP/1.1 200 OK\r\nServer: s\r\nETAG :  \"e\"  \r\ncontent-length:%d\r\n"
        b"X-Amz-Checksum-CRC64NVME: AAAAAAAAAAA=\r\nX-AMZ-CHECKSUM-TYPE: FULL_OBJECT\r\n"
        b"x-amz-server-side-encryption: AES256\r\n\r\n" % N + BODY),
    "repeated names: the first kept": (
        b"HTTP/1.1 200 OK\r\nETag: \"a\"\r\nContent-Length: %d\r\nETag: \"b\"\r\n"
        b"Content-Length: 7\r\n\r\n" % N + BODY),
    "a ranged answer": (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-%d/99999\r\n"
                        b"Content-Length: %d\r\n\r\n" % (N - 1, N) + BODY),
    "an error answer of another length": (
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 31\r\n\r\n<Error><Code>NoSuchKey</Code>x"),
    "an error answer of the same length": (
        b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n" % N + BODY),
    "more bytes than the length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % N
                                  + BODY + b"HTTP/1.1 200 OK\r\n",
    "a longer length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (N + 1) + BODY + b"x",
    "connection: close": b"HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: %d\r\n\r\n"
                         % N + BODY,
    "HTTP/1.0": b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % N + BODY,
    "HTTP/1.0 kept alive": (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: %d"
                            b"\r\n\r\n" % N + BODY),
    "interim answers": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d"
                        b"\r\nETag: \"e\"\r\n\r\n" % N + BODY),
    "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nETag: \"e\"\r\n\r\n"
                b"%x\r\n" % N + BODY + b"\r\n0\r\n\r\n"),
    "framed by the end of the stream": b"HTTP/1.1 200 OK\r\nETag: \"e\"\r\n\r\n" + BODY,
    "a folded header": (b"HTTP/1.1 200 OK\r\nETag: \"e\r\n  f\"\r\nContent-Length: %d\r\n\r\n"
                        % N + BODY),
    "bare line feeds": b"HTTP/1.1 200 OK\nContent-Length: %d\nETag: \"e\"\n\n" % N + BODY,
    "a bad length": b"HTTP/1.1 200 OK\r\nContent-Length: 1_0240\r\n\r\n" + BODY,
    "a negative length": b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n" + BODY,
    "a malformed status line": b"HTTP/2 200 OK\r\nContent-Length: %d\r\n\r\n" % N + BODY,
    "a status line without a reason": b"HTTP/1.1 200\r\nContent-Length: %d\r\n\r\n" % N + BODY,
    "a status of four digits": b"HTTP/1.1 2000 OK\r\nContent-Length: %d\r\n\r\n" % N + BODY,
    "a header line without a colon": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nnonsense\r\n"
                                      b"\r\n" % N + BODY),
    "101 headers": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % N
                    + b"".join(b"X-H%d: v\r\n" % i for i in range(100)) + b"\r\n" + BODY),
    "a head longer than one read": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Long: %s\r\n"
                                    b"ETag: \"e\"\r\n\r\n" % (N, b"v" * 20000) + BODY),
    "no content": b"HTTP/1.1 204 No Content\r\nContent-Length: %d\r\n\r\n" % N,
    "a head cut short": b"HTTP/1.1 200 OK\r\nContent-Len",
    "nothing": b"",
}


@pytest.mark.parametrize("name", list(ANSWERS))
def test_every_answer_is_read_as_read_answer_reads_it(name: str, wire: str) -> None:
    raw = ANSWERS[name]
    for wanted in (WANTED, ()):
        expected = _as_read_answer_reads(raw, N, wanted)
        got = _as_exchanged(raw, N, wanted)
        if (isinstance(expected, tuple) and len(expected) == 4 and isinstance(got, tuple)
                and len(got) == 2 and got[0] is http.client.IncompleteRead):
            # read_answer returns a body framed by the stream's end as it is; a GET that
            # expects N bytes calls it short (as RangeClient.get would)
            assert len(expected[2]) < N, name
            continue
        assert got == expected, name


def test_the_request_is_sent_as_given(wire: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        request = http1.request("GET", "/b/k%20x", {"Host": "h:1", "If-Match": '"e"'})
        server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        exchange = Exchange(5.0)
        http1.set_idle_timeout(client, 5.0)
        assert http1.exchange_plain(client, request, 2, exchange, 5.0)[:3] == (
            200, {"content-length": "2"}, b"ok")
        client.shutdown(socket.SHUT_WR)
        sent = b"".join(iter(lambda: server.recv(65536), b""))
    assert sent == request
    assert exchange.first_byte_at is not None and exchange.progress_at >= exchange.first_byte_at


@pytest.mark.parametrize("state", ["open", "closed by the server", "sent something unasked"])
def test_a_pooled_connection_the_server_closed_is_not_sent_on(wire: str, state: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        http1.set_idle_timeout(client, 5.0)
        if state == "closed by the server":
            server.shutdown(socket.SHUT_WR)  # (an idle timeout's close: readable, at its end)
        elif state == "sent something unasked":
            server.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        else:
            def serve() -> None:
                server.recv(65536)
                server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            threading.Thread(target=serve, daemon=True).start()
        got = http1.exchange_plain(client, b"GET / HTTP/1.1\r\n\r\n", 2, Exchange(5.0), 5.0,
                                   pooled=True)
        if state != "open":
            client.shutdown(socket.SHUT_WR)
            assert server.recv(65536) == b""  # nothing was sent
    if state == "open":
        assert got is not None and got[:3] == (200, {"content-length": "2"}, b"ok")
    else:
        assert got is None


@pytest.mark.parametrize("case", ["200", "md5 not asked", "a stated checksum", "206", "short"])
def test_the_md5_is_computed_on_the_way_only_when_it_will_be_checked(wire: str, case: str) -> None:
    body = os.urandom(110_000)
    status = b"206 Partial Content" if case == "206" else b"200 OK"
    extra = b"x-amz-checksum-crc32c: AAAAAA==\r\n" if case == "a stated checksum" else b""
    client, server = socket.socketpair()
    with client, server:
        server.sendall(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n" % (status, len(body), extra)
                       + (body[:50_000] if case == "short" else body))
        if case == "short":
            server.shutdown(socket.SHUT_WR)
            with pytest.raises(http.client.IncompleteRead) as info:
                _exchange(client, expect=len(body))
            assert info.value.partial == body[:50_000]
            return
        (_, _, got, _, md5), _ = _exchange(client, expect=len(body), md5=case != "md5 not asked")
    assert got == body
    if wire == "native" and case == "200":
        assert md5 == hashlib.md5(body).digest()
    else:
        assert md5 is None


def test_the_native_md5_is_md5() -> None:
    if not http1.NATIVE_EXCHANGE:
        pytest.skip("built without the exchange extension")
    for n in (0, 1, 55, 56, 64, 4097, 110_000):
        data = os.urandom(n)
        assert http1._wire.md5(data) == hashlib.md5(data).digest()


# -- faults on the wire ------------------------------------------------------------------------
def test_a_body_in_many_segments_arrives_whole(wire: str) -> None:
    body = os.urandom(110_080)
    client, server = socket.socketpair()
    with client, server:
        pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)] + [
            body[i:i + 1460] for i in range(0, len(body), 1460)]
        sender = send_slowly(server, pieces, 0.001)
        (status, _, got, _, md5), exchange = _exchange(client, expect=len(body))
        sender.join()
    assert (status, got) == (200, body)
    assert md5 in (None, hashlib.md5(body).digest())
    assert exchange.first_byte_at is not None


def test_a_slow_but_progressing_body_outlives_the_idle_timeout(wire: str) -> None:
    """2 s of body, never silent for the 0.5 s idle timeout: it arrives whole, and a
    waiter watching the exchange never sees a silence near the idle timeout."""
    client, server = socket.socketpair()
    with client, server:
        sender = send_slowly(server, [b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n"]
                              + [b"s" * 100] * 20, 0.1)
        seen: list[float] = []
        exchange = Exchange(0.5)

        def watch() -> None:
            for _ in range(30):
                seen.append(time.monotonic() - exchange.progress_at)
                time.sleep(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        http1.set_idle_timeout(client, 0.5)
        exchange.sending()
        watcher.start()
        status, _, got, _, _ = http1.exchange_plain(client, b"GET / HTTP/1.1\r\n\r\n", 2000,
                                                   exchange, 0.5, (), True)
        sender.join()
        watcher.join()
    assert (status, got) == (200, b"s" * 2000)
    # the silences a waiter saw: the sender's 0.1 s gaps, plus at most one slice of
    # reporting delay on the native path
    assert max(seen) < 0.5


@pytest.mark.parametrize("when", ["before the head", "mid-body"])
def test_a_stall_past_the_idle_timeout_is_a_timeout(wire: str, when: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        if when == "mid-body":
            server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 400)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            _exchange(client, idle=0.5, expect=1000)
        assert 0.45 < time.monotonic() - t0 < 10  # (upper bound: a hang guard)


@pytest.mark.parametrize("during", ["head", "body"])
def test_a_shutdown_from_another_thread_ends_the_exchange(wire: str, during: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        if during == "body":
            server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 400)
        exchange = Exchange(60.0)
        http1.set_idle_timeout(client, 60.0)
        exchange.sending()
        exchange.attach(client)
        threading.Timer(0.3, exchange.abort).start()
        t0 = time.monotonic()
        with pytest.raises((http.client.HTTPException, OSError)):
            http1.exchange_plain(client, b"GET / HTTP/1.1\r\n\r\n", 100_000, exchange, 60.0)
        assert time.monotonic() - t0 < 10  # not the 60 s idle timeout
        assert (exchange.first_byte_at is not None) == (during == "body")


def test_a_head_before_a_stalled_body_is_reported_within_a_slice(wire: str) -> None:
    """The head came, the body does not: a waiter sees the first byte within about one
    SO_RCVTIMEO slice (not only when the answer ends), and an abort then ends it."""
    client, server = socket.socketpair()
    with client, server:
        server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n")
        exchange = Exchange(60.0)
        http1.set_idle_timeout(client, 60.0)
        exchange.sending()
        exchange.attach(client)
        seen: list[float] = []

        def watch() -> None:
            deadline = time.monotonic() + 10
            while exchange.first_byte_at is None and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(time.monotonic())
            exchange.abort()
        threading.Thread(target=watch, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises((http.client.HTTPException, OSError)):
            http1.exchange_plain(client, b"GET / HTTP/1.1\r\n\r\n", 5000, exchange, 60.0)
    assert seen and seen[0] - t0 < 4 * http1.SLICE


def test_a_reset_mid_body_is_a_connection_error(wire: str) -> None:
    """A TCP reset (not an orderly end) while the body arrives: ConnectionResetError, with
    the bytes that came reported (the client does not take it for a closed kept-alive
    connection to resend on)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client:
            def serve() -> None:  # the request read, then the head, part of the body, a reset
                while not server.recv(65536).endswith(b"\r\n\r\n"):
                    pass
                server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 400)
                time.sleep(0.3)
                server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                server.close()
            threading.Thread(target=serve, daemon=True).start()
            exchange = Exchange(5.0)
            http1.set_idle_timeout(client, 5.0)
            exchange.sending()
            with pytest.raises(ConnectionResetError):
                http1.exchange_plain(client, b"GET / HTTP/1.1\r\n\r\n", 100_000, exchange, 5.0)
            assert exchange.first_byte_at is not None


# -- against a real S3 server -------------------------------------------------------------------
def _put(bucket: tuple[Any, str], key: str, data: bytes) -> str:
    client, name = bucket
    client.put_object(Bucket=name, Key=key, Body=data)
    return str(client.head_object(Bucket=name, Key=key)["ETag"].strip('"'))


def test_altered_bytes_fail_the_etag_check_made_on_the_way(bucket, s3_endpoint, wire: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-object GET's body with 8 bytes flipped on the way (same length): the MD5
    computed as it arrived is the altered bytes', and the ETag check fails; unaltered, it
    passes. On the native path the MD5 was computed in the exchange's one call."""
    data = os.urandom(110_000)
    etag = _put(bucket, "m.bin", data)
    calls = [0]
    if wire == "native":
        exchange = http1._wire.exchange

        def counted(*args: Any) -> Any:
            calls[0] += 1
            return exchange(*args)
        monkeypatch.setattr(http1._wire, "exchange", counted)
    with FaultProxy(s3_endpoint) as proxy:
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        for fault in ("pass", "flip", "pass"):
            proxy.plan = lambda method, path, n, fault=fault: fault if method == "GET" else "pass"
            body = store.get("m.bin", etag, 0, len(data), whole=True, md5=True)
            assert body.etag_md5 and body.checksum is None
            assert (body.data == data) == (fault == "pass")
            if wire == "native":
                assert body.md5 == hashlib.md5(body.data).digest()
            else:
                assert body.md5 is None
            if fault == "pass":
                assert integrity.check_whole(body.data, where="s3://b/m.bin", stated=None,
                                             etag=etag, etag_md5=True, md5=body.md5) == "etag_md5"
            else:
                with pytest.raises(IntegrityError):
                    integrity.check_whole(body.data, where="s3://b/m.bin", stated=None, etag=etag,
                                          etag_md5=True, md5=body.md5)
    assert calls[0] == (3 if wire == "native" else 0)
