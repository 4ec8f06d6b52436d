"""Receiving S3 answers that arrive in many small segments: CPU and recv() calls per body.

Through the WAN emulator (benchmarks/wan.py) a 110 KB body reaches the client in a
few large chunks; over a real long-distance link it arrives in 1,448-byte segments
spread over the transfer time. This starts a sender process that answers each
request on a loopback TCP connection with a 110 KB ``Content-Length`` body in
1,448-byte segments (``TCP_NODELAY``) paced to ``--conn-MBps`` per connection, and
reads the answers in ``--threads`` threads of this process, once with cachefs's
reader (:class:`cachefs.s3.http1.SocketReader`: a blocking socket, the body in one
``MSG_WAITALL`` recv) and once with the reader it replaced (``io.BufferedReader``
over the socket with Python's socket timeout, a progress report per recv), in
interleaved rounds. Run::

    python -m benchmarks.pacedrecv [--answers 2000] [--threads 16] [--conn-MBps 16]

It prints CPU (this process, user + system), recv() calls, context switches and the
time per answer (wall time x threads / answers: ~7 ms at 16 MB/s when nothing waits).
"""

from __future__ import annotations

import argparse
import io
import resource
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from cachefs.s3 import http1
from cachefs.s3.store import Exchange

BODY = 110_000
SEGMENT = 1448

SENDER = r'''
import socket, sys, threading, time
body_len, seg, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(128)
print(srv.getsockname()[1], flush=True)
answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nETag: \"x\"\r\n\r\n" % body_len + b"b" * body_len
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return
            buf += d
        buf = buf.split(b"\r\n\r\n", 1)[1]
        view, start = memoryview(answer), time.monotonic()
        for i in range(0, len(answer), seg):
            due = start + i / rate
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            c.sendall(view[i:i + seg])
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


class _OldReader(io.RawIOBase):
    """The reader cachefs used before: the socket's raw reader, a progress report per recv."""

    def __init__(self, raw: Any, exchange: Exchange) -> None:
        super().__init__()
        self._raw, self._exchange = raw, exchange

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        n: int | None = self._raw.readinto(b)
        if n:
            self._exchange.received()
        return n


def _cpu() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def one_round(port: int, kind: str, answers: int, threads: int
              ) -> tuple[float, float, float, float]:
    calls = [0]
    lock = threading.Lock()
    left = [answers]

    def worker() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if kind == "waitall":
            http1.set_idle_timeout(sock, 5.0)
        else:
            sock.settimeout(5.0)
        raw = sock.makefile("rb", buffering=0)
        mine = 0
        with sock:
            while True:
                with lock:
                    if left[0] <= 0:
                        break
                    left[0] -= 1
                exchange = Exchange(5.0)
                exchange.sending()
                http1.send(sock, "GET", "/b/k", {"Host": "x"})
                reader: Any
                if kind == "waitall":
                    reader = http1.SocketReader(sock, exchange, 5.0)
                else:
                    reader = io.BufferedReader(_OldReader(raw, exchange))
                status, _, body, _ = http1.read_answer(reader, "GET")
                assert status == 200 and len(body) == BODY
                mine += 1
        with lock:
            calls[0] += mine

    orig = {name: getattr(socket.socket, name) for name in ("recv", "recv_into")}
    counted = [0]

    def wrap(name: str) -> Any:
        f = orig[name]

        def call(sock: socket.socket, *a: Any, **kw: Any) -> Any:
            counted[0] += 1
            return f(sock, *a, **kw)
        return call

    for name in orig:
        setattr(socket.socket, name, wrap(name))
    try:
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        c0, w0 = _cpu(), time.monotonic()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        c1, wall = _cpu(), time.monotonic() - w0
    finally:
        for name, f in orig.items():
            setattr(socket.socket, name, f)
    return ((c1[0] - c0[0]) / answers * 1e6, counted[0] / answers,
            (c1[1] - c0[1]) / answers, wall / answers * threads * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--conn-MBps", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(BODY), str(SEGMENT),
                               str(args.conn_MBps * 1e6)], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        port = int(sender.stdout.readline())
        print(f"{args.answers} answers of {BODY} bytes in {SEGMENT}-byte segments at "
              f"{args.conn_MBps} MB/s per connection, {args.threads} threads")
        for r in range(args.rounds):
            for kind in ("socket timeout (before)", "waitall"):
                cpu, recvs, switches, ms = one_round(
                    port, "waitall" if kind == "waitall" else "old", args.answers, args.threads)
                print(f"round {r} {kind:24s} CPU {cpu:6.1f} us/answer  recv {recvs:5.1f}/answer"
                      f"  context switches {switches:5.1f}/answer  {ms:5.1f} ms/answer",
                      flush=True)
                time.sleep(0.5)
    finally:
        sender.kill()
        sender.wait()


if __name__ == "__main__":
    main()
