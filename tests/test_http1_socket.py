"""The S3 client's socket reader (cachefs.s3.http1.SocketReader) on real socket pairs:
bodies in few recv() calls, progress while a slow body arrives, the idle timeout, and
aborts from another thread."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from cachefs.s3 import http1
from cachefs.s3.store import Exchange
from tests.conftest import send_slowly

HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n"


class _Counted(Exchange):
    __slots__ = ("arrivals",)

    def __init__(self, idle_timeout: float) -> None:
        super().__init__(idle_timeout)
        self.arrivals = 0

    def received(self) -> None:
        self.arrivals += 1
        super().received()


def _reader(client: socket.socket, idle: float) -> tuple[http1.SocketReader, _Counted]:
    exchange = _Counted(idle)
    exchange.sending()
    http1.set_idle_timeout(client, idle)
    return http1.SocketReader(client, exchange, idle), exchange


def test_a_body_sent_in_many_segments_is_received_in_few_calls() -> None:
    body = bytes(range(256)) * 430  # 110,080 bytes
    client, server = socket.socketpair()
    with client, server:
        reader, exchange = _reader(client, 5.0)
        pieces = [HEAD % len(body)] + [body[i:i + 1460] for i in range(0, len(body), 1460)]
        sender = send_slowly(server, pieces, 0.001)
        status, _, got, _ = http1.read_answer(reader, "GET")
        sender.join()
    assert (status, got) == (200, body)
    # The head, then the rest at once (MSG_WAITALL), give or take a slice boundary; one
    # recv() per segment would be ~76.
    assert exchange.arrivals <= 10


def test_a_slow_but_progressing_body_outlives_the_idle_timeout() -> None:
    body = b"s" * 2000
    client, server = socket.socketpair()
    with client, server:
        reader, exchange = _reader(client, 0.5)
        # 2 s in all, never silent for 0.5 s: progress is reported while it arrives.
        sender = send_slowly(server, [HEAD % len(body)] + [b"s" * 100] * 20, 0.1)
        reported: list[float] = []
        watcher = threading.Thread(target=lambda: [
            (reported.append(time.monotonic() - exchange.progress_at), time.sleep(0.05))
            for _ in range(30)], daemon=True)
        watcher.start()
        status, _, got, _ = http1.read_answer(reader, "GET")
        sender.join()
        watcher.join()
    assert (status, got) == (200, body)
    # what a hedging waiter saw: never a silence near the idle timeout
    assert max(reported) < 0.5


def test_a_body_that_goes_silent_ends_at_the_idle_timeout() -> None:
    client, server = socket.socketpair()
    with client, server:
        reader, _ = _reader(client, 0.5)
        server.sendall(HEAD % 1000 + b"x" * 400)  # then nothing
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            http1.read_answer(reader, "GET")
        assert 0.4 < time.monotonic() - t0 < 10  # (upper bound: a hang guard)


@pytest.mark.parametrize("during", ["head", "body"])
def test_a_shutdown_from_another_thread_wakes_the_reader(during: str) -> None:
    client, server = socket.socketpair()
    with client, server:
        reader, _ = _reader(client, 60.0)
        if during == "body":
            server.sendall(HEAD % 100_000 + b"x" * 400)
        threading.Timer(0.3, socket.socket.shutdown, (client, socket.SHUT_RDWR)).start()
        t0 = time.monotonic()
        with pytest.raises((http.client.HTTPException, OSError)):
            http1.read_answer(reader, "GET")
        assert time.monotonic() - t0 < 10  # not the 60 s idle timeout


@pytest.mark.parametrize("pace", ["at_once", "across_slices"])
def test_a_large_body_is_received_in_place_whole_and_exact(pace: str) -> None:
    """A body of IN_PLACE_BODY bytes or more goes into one buffer of its size, whatever
    the head's recv() already took of it and however many recv() calls the rest needs
    (here: across SO_RCVTIMEO slices), so it is never joined from parts."""
    body = bytes(range(256)) * ((http1.IN_PLACE_BODY + 300_000) // 256)
    client, server = socket.socketpair()
    with client, server:
        reader, exchange = _reader(client, 5.0)
        if pace == "at_once":
            sender = send_slowly(server, [HEAD % len(body) + body], 0)
        else:  # the head with part of the body, then pieces slower than one slice
            cut = len(body) // 3
            sender = send_slowly(server, [HEAD % len(body) + body[:5000], body[5000:cut],
                                           body[cut:]], http1.SLICE * 1.5)
        status, _, got, _ = http1.read_answer(reader, "GET")
        sender.join()
    assert status == 200 and len(got) == len(body) and got == body
    assert isinstance(got, bytearray)  # received in place (bytes-like, never changed)
    if pace == "across_slices":
        assert exchange.arrivals >= 3


def test_a_large_body_cut_short_is_returned_short_for_the_caller_to_judge() -> None:
    n = http1.IN_PLACE_BODY + 10
    client, server = socket.socketpair()
    with client:
        reader, _ = _reader(client, 5.0)
        server.sendall(HEAD % n + b"z" * 1000)
        server.close()
        with pytest.raises(http.client.IncompleteRead):
            http1.read_answer(reader, "GET")
