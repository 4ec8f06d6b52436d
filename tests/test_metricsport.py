"""The metrics port (cachefs.metricsport) on a real socket: what a scraper and what a
misbehaving client get. (The port in a mounted daemon: tests/test_local_users.py.)"""

from __future__ import annotations

import gzip
import http.client
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cachefs import metricsport
from cachefs.errors import ConfigError


@pytest.fixture
def port() -> Iterator[tuple[str, int]]:
    yield metricsport.serve_metrics("127.0.0.1:0")


def _get(addr: tuple[str, int], path: str = "/metrics", method: str = "GET",
         headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*addr, timeout=10)
    conn.request(method, path, headers=headers or {})
    return conn.getresponse()


def _raw(addr: tuple[str, int], request: bytes) -> bytes:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_a_scrape_gets_the_page_in_text_format_and_the_connection_closes(port) -> None:
    answer = _get(port)
    body = answer.read()
    assert answer.status == 200
    assert answer.getheader("Content-Type", "").startswith("text/plain")
    assert int(answer.getheader("Content-Length", "-1")) == len(body)
    assert answer.getheader("Connection") == "close"
    assert b"cachefs_build_info" in body


def test_openmetrics_and_gzip_are_those_of_prometheus_client(port) -> None:
    answer = _get(port,
                  headers={"Accept": "application/openmetrics-text; version=1.0.0",
                           "Accept-Encoding": "gzip"})
    assert answer.status == 200
    assert answer.getheader("Content-Type", "").startswith("application/openmetrics-text")
    assert answer.getheader("Content-Encoding") == "gzip"
    body = gzip.decompress(answer.read())
    assert b"cachefs_build_info" in body and body.rstrip().endswith(b"# EOF")


def test_options_is_answered_and_other_methods_are_refused(port) -> None:
    options = _get(port, method="OPTIONS")
    assert options.status == 200 and options.getheader("Allow") == "OPTIONS,GET"
    head = _get(port, method="HEAD")
    assert head.status == 405 and head.read() == b""  # (no body for a HEAD)
    post = _get(port, method="POST")
    assert post.status == 405 and post.getheader("Allow") == "OPTIONS,GET"


def test_a_bad_request_line_and_an_endless_header_get_one_short_answer(port) -> None:
    assert _raw(port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    endless = b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"y" * (metricsport.MAX_REQUEST + 10)
    assert _raw(port, endless).startswith(b"HTTP/1.1 431 ")


def test_a_client_that_never_ends_its_request_is_cut_off_at_its_deadline(port) -> None:
    with socket.create_connection(port, timeout=metricsport.REQUEST_DEADLINE + 10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        assert s.recv(1) == b""  # closed, with no answer
        assert time.monotonic() - started >= metricsport.REQUEST_DEADLINE - 1
    assert _get(port).status == 200


def test_more_connections_than_are_read_at_once_close_the_oldest_not_the_scrape(
        port, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of connections that never send a request: the reader keeps the newest
    MAX_READING, closing the oldest, and a scrape arriving after them is answered."""
    monkeypatch.setattr(metricsport, "MAX_READING", 8)
    idle = [socket.create_connection(port, timeout=10) for _ in range(20)]
    try:
        time.sleep(0.3)  # (all accepted)
        assert _get(port).status == 200
        closed = 0
        for s in idle[:12]:  # the oldest were closed to make room
            s.settimeout(1)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
        assert closed >= 10
    finally:
        for s in idle:
            s.close()


def test_scrapes_from_many_clients_at_once_are_all_answered(port) -> None:
    statuses: list[int] = []

    def scrape() -> None:
        for _ in range(5):
            answer = _get(port)
            answer.read()
            statuses.append(answer.status)

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 40  # (fewer at once than the queue holds: none is refused)


def test_an_address_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        host, p = taken.getsockname()
        with pytest.raises(ConfigError, match="address already in use"):
            metricsport.serve_metrics(f"{host}:{p}")


def test_out_of_descriptors_the_port_waits_and_serves_once_there_are_some(port) -> None:
    """An accept that fails for want of descriptors leaves the connection queued (one log
    line), without spinning, and the scrape is answered once descriptors are free."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog: list[int] = []
    answers: list[int] = []
    try:
        with socket.socket() as s:  # (made before the descriptors go; connected after)
            s.settimeout(20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64,
                                                        hard))
            try:
                while True:
                    hog.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            s.connect(port)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            cpu = time.process_time()
            time.sleep(1)
            assert time.process_time() - cpu < 0.5, "the port spun while out of descriptors"
            for fd in hog:
                os.close(fd)
            hog.clear()
            answers.append(int(s.recv(12).split()[1]))
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert answers == [200]
