"""CPU per cold small file in the S3 worker threads: GET, whole-object check, cache write.

What one of cachefs's S3 worker threads does for a cold single-block file
(cachefs/s3/origin.py ``Origin.get(sink=...)``): a signed whole-object GET on a
kept-alive connection (:class:`cachefs.s3.ranges.RangeClient`), the check
against the ETag's MD5 or a stated checksum (:func:`cachefs.s3.integrity.check_whole`)
and the write to the disk cache (:meth:`cachefs.cache.blocks.BlockCache.put_now`:
object file + LMDB index entry). ``--threads`` threads do this for
``--files`` objects of 80-140 KB on a SeaweedFS server, optionally through
the WAN emulator (``--rtt-ms``; a separate process, so the CPU measured is the
client's alone). Run::

    python -m benchmarks.coldget [--files 1200] [--threads 32] [--rtt-ms 70] [--rounds 3]
    python -m benchmarks.coldget --compare OTHER_CHECKOUT,. ...   # interleaved rounds
    python -m benchmarks.coldget --engine epoll [--writers N] ...  # one thread, all sockets

It prints, per file: this process's CPU (user + system, from getrusage), files/s,
recv calls (``--count-recv``), page faults, context switches, and the threads' CPU in each phase (thread CPU
clocks): the GET, the check, the cache write, and the write's parts: the object
file (create, write, close) and the index entry.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.origin import ACCESS_KEY, REGION, SECRET_KEY, SeaweedOrigin

BUCKET = "coldget"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _counts() -> tuple[int, int]:
    """(page faults, context switches) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt, r.ru_nvcsw + r.ru_nivcsw


class _Counting:
    """Counts socket.recv and socket.recv_into calls (wraps the methods for the run)."""

    def __init__(self) -> None:
        self.calls = 0
        self.saved: dict[str, Any] = {}

    def install(self) -> None:
        counter = self
        for name in ("recv", "recv_into"):
            orig = self.saved[name] = getattr(socket.socket, name)

            def counted(sock: socket.socket, *args: Any, _orig: Any = orig, **kw: Any) -> Any:
                counter.calls += 1  # a racy +=, close enough for a count
                return _orig(sock, *args, **kw)

            setattr(socket.socket, name, counted)

    def remove(self) -> None:
        for name, orig in self.saved.items():
            setattr(socket.socket, name, orig)


def _client_and_cache(endpoint: str, connections: int, root: Path) -> tuple[Any, Any, Any]:
    """cachefs's S3 client for the bucket, and a cache (index and block files) under
    ``root``, as the daemon makes them."""
    import botocore.credentials

    from cachefs.cache.blocks import BlockCache
    from cachefs.cache.lmdbenv import LmdbEnv
    from cachefs.s3.ranges import RangeClient

    client = RangeClient(BUCKET, endpoint_url=endpoint, region=REGION,
                         credentials=botocore.credentials.Credentials(ACCESS_KEY, SECRET_KEY),
                         anonymous=False, max_connections=connections, connect_timeout=5,
                         read_timeout=30)
    env = LmdbEnv(root / "index")
    return client, env, BlockCache(env, root / "cache", capacity=1 << 40, policy="keep")


def run(endpoint: str, keys: list[tuple[str, str]], threads: int, root: Path,
        count_recv: bool) -> dict[str, float]:
    from cachefs.cache.blocks import block_id
    from cachefs.s3 import integrity
    from cachefs.s3.store import Exchange

    client, env, cache = _client_and_cache(endpoint, threads, root)
    work: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
    phases = {"get": 0.0, "check": 0.0, "write": 0.0, "file": 0.0, "index": 0.0}
    lock = threading.Lock()
    local = threading.local()

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                local.mine[name] += time.thread_time() - t0
        return call

    # the write's two parts: the object file (create, write, close) and the index entry
    cache.files.write_at = timed("file", cache.files.write_at)  # type: ignore[method-assign]
    cache.index.put = timed("index", cache.index.put)  # type: ignore[method-assign]
    counter = _Counting()
    if count_recv:
        counter.install()

    def worker() -> None:
        mine = local.mine = dict.fromkeys(phases, 0.0)
        while (item := work.get()) is not None:
            key, etag = item
            t0 = time.thread_time()
            body = client.get(key, etag, 0, sizes[key], whole=True, exchange=Exchange(30))
            t1 = time.thread_time()
            integrity.check_whole(body.data, where=key, stated=body.checksum, etag=etag,
                                  etag_md5=body.etag_md5)
            t2 = time.thread_time()
            cache.put_now(block_id(BUCKET, key, etag, 1 << 20, 0), body.data)
            t3 = time.thread_time()
            mine["get"] += t1 - t0
            mine["check"] += t2 - t1
            mine["write"] += t3 - t2
        with lock:
            for k, v in mine.items():
                phases[k] += v

    # open the connections first (not measured)
    warm = [threading.Thread(target=client.get, args=(key, etag, 0, sizes[key]),
                             kwargs={"whole": True}) for key, etag in keys[:threads]]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    counter.calls = 0
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    c0, w0, n0 = _cpu(), time.monotonic(), _counts()
    for t in pool:
        t.start()
    for item in keys:
        work.put(item)
    for _ in pool:
        work.put(None)
    for t in pool:
        t.join()
    cpu, wall, n1 = _cpu() - c0, time.monotonic() - w0, _counts()
    counter.remove()
    env.close()
    n = len(keys)
    out = {"cpu_us": cpu / n * 1e6, "files_s": n / wall, "recv": counter.calls / n,
           "faults": (n1[0] - n0[0]) / n, "switches": (n1[1] - n0[1]) / n}
    out.update({f"{k}_us": v / n * 1e6 for k, v in phases.items()})
    return out


def run_epoll(endpoint: str, keys: list[tuple[str, str]], in_flight: int, root: Path,
              writers: int) -> dict[str, float]:
    """The same work with no thread per GET: one thread drives ``in_flight`` kept-alive
    connections with epoll (non-blocking sockets; each answer parsed when its last byte
    is in), and checks and writes each answer itself (``writers`` 0) or hands it to
    ``writers`` threads. A measurement of the lever, not cachefs's code path: no
    retries, hedging, idle timeouts or chunked answers."""
    import selectors
    import urllib.parse

    from cachefs.cache.blocks import block_id
    from cachefs.s3 import http1, integrity
    from cachefs.s3.integrity import etag_is_md5, stated_checksum

    client, env, cache = _client_and_cache(endpoint, in_flight, root)
    url = urllib.parse.urlsplit(endpoint)
    done: queue.SimpleQueue[tuple[str, str, bytes, dict[str, str]] | None] = queue.SimpleQueue()

    def finish(key: str, etag: str, data: bytes, headers: dict[str, str]) -> None:
        integrity.check_whole(data, where=key, stated=stated_checksum(headers), etag=etag,
                              etag_md5=etag_is_md5(etag, headers))
        cache.put_now(block_id(BUCKET, key, etag, 1 << 20, 0), data)

    def writer() -> None:
        while (item := done.get()) is not None:
            finish(*item)

    def request(key: str, etag: str) -> bytes:
        path = client._object_path(key)
        headers = client._signed("GET", path, {"If-Match": f'"{etag}"',
                                               "x-amz-checksum-mode": "ENABLED"})
        lines = [f"GET {path} HTTP/1.1\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
        lines.append("Accept-Encoding: identity\r\n\r\n")
        return "".join(lines).encode("latin-1")

    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(in_flight):
        sock = socket.create_connection((url.hostname, url.port or 80))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        socks.append(sock)
    todo = list(reversed(keys))
    pool = [threading.Thread(target=writer) for _ in range(writers)]
    c0, w0, n0 = _cpu(), time.monotonic(), _counts()
    for t in pool:
        t.start()
    pending = 0

    def start(sock: socket.socket) -> None:
        nonlocal pending
        if not todo:
            return
        key, etag = todo.pop()
        sock.sendall(request(key, etag))  # (a few hundred bytes: the send buffer takes them)
        # (key, etag, bytes so far, header length, total length, headers)
        sel.register(sock, selectors.EVENT_READ, [key, etag, bytearray(), 0, -1, {}])
        pending += 1

    for sock in socks:
        start(sock)
    while pending:
        for sk, _ in sel.select():
            sock: Any = sk.fileobj
            state = sk.data
            try:
                chunk = sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                raise RuntimeError("the server closed a connection")
            buf = state[2]
            buf += chunk
            if state[4] < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    continue
                status, headers, _, _ = http1.read_answer(_BytesReader(bytes(buf[:end + 4])),
                                                          "HEAD")
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                state[3] = end + 4
                state[4] = end + 4 + int(headers["content-length"])
                state[5] = headers
            if len(buf) >= state[4]:
                sel.unregister(sock)
                pending -= 1
                item = (state[0], state[1], bytes(buf[state[3]:state[4]]), state[5])
                if writers:
                    done.put(item)
                else:
                    finish(*item)
                start(sock)
    for _ in pool:
        done.put(None)
    for t in pool:
        t.join()
    cpu, wall, n1 = _cpu() - c0, time.monotonic() - w0, _counts()
    for sock in socks:
        sock.close()
    env.close()
    n = len(keys)
    return {"cpu_us": cpu / n * 1e6, "files_s": n / wall,
            "faults": (n1[0] - n0[0]) / n, "switches": (n1[1] - n0[1]) / n}


class _BytesReader:
    """:func:`cachefs.s3.http1.read_answer`'s reads from bytes in memory."""

    def __init__(self, data: bytes) -> None:
        import io
        self._io = io.BytesIO(data)

    def readline(self, limit: int = -1, /) -> bytes:
        return self._io.readline(limit)

    def read(self, n: int = -1, /) -> bytes:
        return self._io.read(n)


sizes: dict[str, int] = {}


def _client_rounds(args: argparse.Namespace, endpoint: str, keys: list[tuple[str, str]],
                   tmp: str) -> None:
    for r in range(args.rounds):
        root = Path(tempfile.mkdtemp(dir=tmp, prefix=f"round{r}-"))
        if args.engine == "epoll":
            out = run_epoll(endpoint, keys, args.threads, root, args.writers)
        else:
            out = run(endpoint, keys, args.threads, root, args.count_recv)
        print(f"round {r}: " + "  ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1200)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="0: no WAN emulator")
    parser.add_argument("--bandwidth-MBps", type=float, default=48.0)
    parser.add_argument("--conn-bandwidth-MBps", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("threads", "epoll"), default="threads",
                        help="threads: one thread per GET in flight, as cachefs; epoll: "
                             "one thread drives --threads connections (the lever's size)")
    parser.add_argument("--writers", type=int, default=0,
                        help="with --engine epoll: threads that check and write answers "
                             "(0: the epoll thread itself)")
    parser.add_argument("--count-recv", action="store_true",
                        help="count recv calls (adds a little CPU)")
    parser.add_argument("--compare", metavar="DIR,DIR",
                        help="interleave runs of the cachefs checkouts in these directories "
                             "(each a repository root), one round each in turn")
    parser.add_argument("--client", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:  # one checkout's rounds against a running origin (--compare)
        spec = json.loads(Path(args.client).read_text())
        sizes.update(spec["sizes"])
        _client_rounds(args, spec["endpoint"], [tuple(k) for k in spec["keys"]],
                       spec["tmp"])
        return
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp, SeaweedOrigin(Path(tmp) / "weed",
                                                            bucket=BUCKET) as origin:
        s3 = origin.client()
        keys = []
        for i in range(args.files):
            key = f"f/{i:05d}.jpg"
            n = rng.randint(80_000, 140_000)
            s3.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(n))
            sizes[key] = n
            keys.append((key, s3.head_object(Bucket=BUCKET, Key=key)["ETag"].strip('"')))
        link = None
        endpoint = origin.endpoint
        if args.rtt_ms:
            from benchmarks.wan import WanLink
            link = WanLink(origin.s3_port, args.rtt_ms, args.bandwidth_MBps,
                           args.conn_bandwidth_MBps).start()
            endpoint = link.endpoint
        try:
            if not args.compare:
                _client_rounds(args, endpoint, keys, tmp)
                return
            spec = Path(tmp) / "spec.json"
            spec.write_text(json.dumps({"endpoint": endpoint, "keys": keys, "sizes": sizes,
                                        "tmp": tmp}))
            dirs = args.compare.split(",")
            for _ in range(args.rounds):
                for d in dirs:
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", str(spec),
                           "--rounds", "1", "--threads", str(args.threads)]
                    if args.count_recv:
                        cmd.append("--count-recv")
                    env = dict(os.environ, PYTHONPATH=str(Path(d).resolve()))
                    out = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True)
                    line = (out.stdout.strip().splitlines() or [out.stderr[-300:]])[-1]
                    print(f"{d}: {line.replace('round 0: ', '')}", flush=True)
        finally:
            if link is not None:
                link.stop()


if __name__ == "__main__":
    main()
