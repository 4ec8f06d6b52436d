"""User-space WAN emulator: a TCP proxy on loopback between clients and the origin.

Kernel netem is unavailable here, so a "remote region" is emulated by this
proxy, run as its own process (``python -m benchmarks.wan``) so that its CPU
time is visible in /proc/<pid>/stat and reported next to the results.

Link model, per direction of every connection:

* Bandwidth: each chunk read from one side is first serialised through token
  buckets, one per connection (``--conn-bandwidth-MBps``) and one shared by all
  connections of that direction (``--bandwidth-MBps``); the bottleneck buffer
  holds at most ``--max-queue-ms`` of data (the reader stops reading from the
  sender until the queue drains, so TCP backpressure reaches the sender).
* Propagation: a chunk is delivered RTT/2 after it finished serialising, so a
  request/response exchange costs one RTT on top of its transfer time.
* Connection set-up: the first bytes of a new connection reach the origin no
  earlier than accept + RTT + RTT/2 (the TCP handshake's round trip, then the
  request's half round trip), so a new connection costs one extra RTT.
* Window: at most ``--window-bytes`` undelivered bytes per direction per
  connection (a TCP receive window); throughput per connection is then at most
  window / RTT, like a real long fat pipe.

Accounting: HTTP/1.1 requests and responses passing through are parsed
(request line, Range/Content-Range/Content-Length, chunked bodies) to count
requests by kind, GET bytes requested and transferred, and unique object bytes
(union of the byte ranges actually transferred, per object). A per-second
series of bytes sent to clients gives link utilisation over time. A control
port answers ``GET /stats`` (JSON) and ``POST /reset``.

asyncio was measured faster than trio for this relay on this machine (see
``bench_relay`` below and RESULTS.md), so the proxy uses asyncio streams.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

CHUNK = 256 * 1024
STREAM_LIMIT = 4 * 1024 * 1024


# ---------------------------------------------------------------- link model
class TokenBucket:
    """Virtual-time token bucket: ``reserve`` returns when ``n`` bytes finish
    serialising at ``rate`` bytes/s (FIFO), with ``burst`` bytes of credit."""

    __slots__ = ("burst_s", "next_free", "rate")

    def __init__(self, rate: float, burst: float = 64 * 1024):
        self.rate = rate
        self.burst_s = burst / rate if rate > 0 else 0.0
        self.next_free = 0.0

    def backlog(self, now: float) -> float:
        """Seconds of queued data ahead of a new byte."""
        return max(0.0, self.next_free - now) if self.rate > 0 else 0.0

    def reserve(self, n: int, now: float) -> float:
        if self.rate <= 0:
            return now
        start = max(self.next_free, now - self.burst_s)
        self.next_free = start + n / self.rate
        return max(now, self.next_free)


@dataclass
class LinkConfig:
    rtt_s: float
    total_rate: float  # bytes/s per direction, 0 = unlimited
    conn_rate: float  # bytes/s per connection and direction, 0 = unlimited
    window: int
    max_queue_s: float


# ---------------------------------------------------------------- accounting
_RANGE_RE = re.compile(rb"bytes\s+(\d+)-(\d+)/(\d+|\*)", re.I)


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    connections: int = 0
    requests: collections.Counter = field(default_factory=collections.Counter)
    status: collections.Counter = field(default_factory=collections.Counter)
    get_requested_bytes: int = 0  # Content-Length of GET object responses
    get_transferred_bytes: int = 0  # body bytes of those responses that crossed the link
    bytes_to_client: int = 0
    bytes_to_origin: int = 0
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    per_second: dict[int, list[int]] = field(default_factory=dict)  # sec -> [bytes_to_client, gets]
    unparsed_connections: int = 0

    def second(self) -> list[int]:
        s = int(time.time())
        row = self.per_second.get(s)
        if row is None:
            row = self.per_second[s] = [0, 0]
        return row

    def unique_bytes(self) -> int:
        total = 0
        for spans in self.ranges.values():
            end = -1
            for a, b in sorted(spans):
                if b <= end:
                    continue
                total += b - max(a, end)
                end = b
        return total

    def snapshot(self) -> dict[str, Any]:
        req = dict(self.requests)
        return {
            "started": self.started,
            "now": time.time(),
            "connections": self.connections,
            "requests": req,
            "get_count": req.get("GET", 0),
            "head_count": req.get("HEAD", 0),
            "list_count": req.get("LIST", 0),
            "status": {str(k): v for k, v in self.status.items()},
            "get_requested_bytes": self.get_requested_bytes,
            "get_transferred_bytes": self.get_transferred_bytes,
            "unique_bytes": self.unique_bytes(),
            "objects_touched": len(self.ranges),
            "bytes_to_client": self.bytes_to_client,
            "bytes_to_origin": self.bytes_to_origin,
            "unparsed_connections": self.unparsed_connections,
            "per_second": [[s, b, g] for s, (b, g) in sorted(self.per_second.items())],
            "cpu_s": _self_cpu(),
        }


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


class HttpTap:
    """Incremental HTTP/1.1 parser for one direction of one connection."""

    def __init__(self, stats: Stats, is_request: bool, pending: collections.deque):
        self.stats = stats
        self.is_request = is_request
        self.pending = pending  # requests awaiting responses (shared by both taps)
        self.state = "head"
        self.head = bytearray()
        self.remaining = 0
        self.dead = False
        # current response body accounting
        self.obj_key: str | None = None
        self.obj_start = 0
        self.obj_done = 0

    def feed(self, data: bytes) -> None:
        if self.dead:
            return
        try:
            self._feed(data)
        except Exception:
            self.dead = True
            self.stats.unparsed_connections += 1

    def _take_line(self, data: bytes, i: int, sep: bytes) -> tuple[bytes | None, bytes, int]:
        """Find ``sep`` from ``i`` (joining with buffered bytes). Returns
        (line including sep or None, data to continue with, index)."""
        if not self.head:
            j = data.find(sep, i)
            if j >= 0:
                return data[i : j + len(sep)], data, j + len(sep)
        self.head += data[i:]
        k = self.head.find(sep)
        if k < 0:
            if len(self.head) > 1 << 20:
                raise ValueError("header too large")
            return None, b"", 0
        line = bytes(self.head[: k + len(sep)])
        rest = bytes(self.head[k + len(sep) :])
        self.head.clear()
        return line, rest, 0

    def _feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            st = self.state
            if st == "head":
                head, data, i = self._take_line(data, i, b"\r\n\r\n")
                n = len(data)
                if head is None:
                    return
                self._on_head(head)
            elif st in ("body", "chunk_data"):
                take = min(self.remaining, n - i)
                self._on_body(take)
                self.remaining -= take
                i += take
                if self.remaining == 0:
                    if st == "body":
                        self._end_message()
                    else:
                        self.state, self.remaining = "chunk_crlf", 2
            elif st == "until_close":
                self._on_body(n - i)
                return
            elif st == "chunk_size":
                line, data, i = self._take_line(data, i, b"\r\n")
                n = len(data)
                if line is None:
                    return
                self._chunk_size(line[:-2])
            elif st == "chunk_crlf":
                take = min(self.remaining, n - i)
                self.remaining -= take
                i += take
                if self.remaining == 0:
                    self.state = "chunk_size"
            elif st == "trailers":
                line, data, i = self._take_line(data, i, b"\r\n")
                n = len(data)
                if line is None:
                    return
                if line == b"\r\n":
                    self._end_message()

    def _chunk_size(self, line: bytes) -> None:
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            self.state = "trailers"
        else:
            self.state = "chunk_data"
            self.remaining = size

    def _on_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        first = lines[0]
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            if not line:
                continue
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if self.is_request:
            method, target, _ = first.split(b" ", 2)
            m = method.decode()
            path, _, query = target.decode("latin-1").partition("?")
            parts = [p for p in path.split("/") if p]
            if m == "GET" and (len(parts) < 2 or "list-type" in query or "prefix=" in query or "delimiter=" in query):
                kind = "LIST" if len(parts) >= 1 else "LISTBUCKETS"
            else:
                kind = m
            self.stats.requests[kind] += 1
            if kind == "GET":
                self.stats.second()[1] += 1
            self.pending.append((kind, path))
            self._set_body(headers, request=True, no_body=False)
        else:
            status = int(first.split(b" ", 2)[1])
            if 100 <= status < 200:
                # interim response: the real one follows, no body
                self.state = "head"
                return
            kind, path = self.pending.popleft() if self.pending else ("?", "")
            self.stats.status[status] += 1
            self.obj_key = None
            if kind == "GET" and status in (200, 206):
                clen = int(headers.get(b"content-length", b"0") or 0)
                self.stats.get_requested_bytes += clen
                start = 0
                if status == 206:
                    mr = _RANGE_RE.search(headers.get(b"content-range", b""))
                    if mr:
                        start = int(mr.group(1))
                self.obj_key, self.obj_start, self.obj_done = path, start, 0
            no_body = kind == "HEAD" or status in (204, 304)
            self._set_body(headers, request=False, no_body=no_body)

    def _set_body(self, headers: dict[bytes, bytes], request: bool, no_body: bool) -> None:
        te = headers.get(b"transfer-encoding", b"").lower()
        if no_body:
            self._end_message()
        elif b"chunked" in te:
            self.state = "chunk_size"
        elif b"content-length" in headers:
            self.remaining = int(headers[b"content-length"])
            self.state = "body" if self.remaining else "head"
            if not self.remaining:
                self._end_message()
        elif request:
            self._end_message()
        else:
            self.state = "until_close"

    def _on_body(self, n: int) -> None:
        if self.obj_key is not None:
            self.obj_done += n
            self.stats.get_transferred_bytes += n

    def _end_message(self) -> None:
        self.state = "head"
        self.close()

    def close(self) -> None:
        if self.obj_key is not None and self.obj_done:
            self.stats.ranges[self.obj_key].append((self.obj_start, self.obj_start + self.obj_done))
        self.obj_key = None


# ---------------------------------------------------------------- proxy
class Direction:
    """One direction of one proxied connection: src transport -> delay line -> dst."""

    def __init__(self, proxy: Proxy, link: TokenBucket, tap: HttpTap, gate: float, to_client: bool):
        self.proxy = proxy
        self.cfg = proxy.cfg
        self.loop = proxy.loop
        self.link = link
        self.conn = TokenBucket(proxy.cfg.conn_rate)
        self.tap = tap
        self.gate = gate
        self.to_client = to_client
        self.half = proxy.cfg.rtt_s / 2
        self.q: collections.deque = collections.deque()
        self.queued = 0
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.recheck: asyncio.TimerHandle | None = None
        self.paused = False
        self.dst_full = False
        self.eof = False
        self.closed = False

    # data from the sender
    def on_data(self, data: bytes) -> None:
        now = self.loop.time()
        n = len(data)
        done = max(self.link.reserve(n, now), self.conn.reserve(n, now), self.gate)
        self.q.append((done + self.half, data))
        self.queued += n
        st = self.proxy.stats
        if self.to_client:
            st.bytes_to_client += n
            st.second()[0] += n
        else:
            st.bytes_to_origin += n
        self.tap.feed(data)
        self._arm()
        self._flow(now)

    def on_eof(self) -> None:
        if self.eof:
            return
        self.eof = True
        now = self.loop.time()
        self.q.append((max(now, self.gate, self.link.next_free, self.conn.next_free) + self.half, None))
        self._arm()

    # delivery
    def _arm(self) -> None:
        if self.timer is None and self.q and self.dst is not None:
            self.timer = self.loop.call_at(self.q[0][0], self._deliver)

    def _deliver(self) -> None:
        self.timer = None
        if self.dst is None or self.closed:
            return
        now = self.loop.time()
        q = self.q
        while q and q[0][0] <= now + 0.0002:
            _, data = q.popleft()
            if data is None:
                self._finish()
                return
            self.dst.write(data)
            self.queued -= len(data)
        self._arm()
        self._flow(now)

    def _finish(self) -> None:
        dst = self.dst
        if dst is not None and not dst.is_closing():
            if dst.can_write_eof():
                with contextlib.suppress(OSError, RuntimeError):
                    dst.write_eof()
            else:
                dst.close()
        self.proxy_done()

    def proxy_done(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.tap.close()
        for h in (self.timer, self.recheck):
            if h is not None:
                h.cancel()
        self.timer = self.recheck = None
        self.on_closed()

    def on_closed(self) -> None:  # replaced by the connection
        pass

    # flow control: stop reading the sender while the bottleneck queue, the
    # window or the receiver's socket buffer is full
    def _flow(self, now: float) -> None:
        if self.src is None or self.closed:
            return
        backlog = max(self.link.backlog(now), self.conn.backlog(now)) - self.cfg.max_queue_s
        want_pause = self.dst_full or self.queued >= self.cfg.window or backlog > 0
        if want_pause and not self.paused:
            self.paused = True
            with contextlib.suppress(RuntimeError, AttributeError):
                self.src.pause_reading()
        elif not want_pause and self.paused:
            self.paused = False
            with contextlib.suppress(RuntimeError, AttributeError):
                self.src.resume_reading()
        if want_pause and backlog > 0 and self.recheck is None:
            self.recheck = self.loop.call_later(backlog, self._recheck)

    def _recheck(self) -> None:
        self.recheck = None
        self._flow(self.loop.time())

    def set_dst_full(self, full: bool) -> None:
        self.dst_full = full
        self._flow(self.loop.time())


class _Side(asyncio.Protocol):
    """Protocol for one socket: feeds ``inbound`` and is the dst of ``outbound``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.inbound: Direction | None = None  # data read here goes here
        self.outbound: Direction | None = None  # data written here comes from here
        self.peer: _Side | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=4 << 20, low=1 << 20)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.inbound is not None:
            self.inbound.on_data(data)

    def eof_received(self) -> bool:
        if self.inbound is not None:
            self.inbound.on_eof()
        return True  # keep the other half open until our EOF is delivered

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.inbound is not None:
            self.inbound.on_eof()
        if self.outbound is not None and not self.outbound.closed:
            # the receiver is gone: drop what is in flight towards it, stop the sender
            self.outbound.q.clear()
            self.outbound.proxy_done()
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.outbound is not None:
            self.outbound.set_dst_full(True)

    def resume_writing(self) -> None:
        if self.outbound is not None:
            self.outbound.set_dst_full(False)


class _ClientSide(_Side):
    def __init__(self, proxy: Proxy):
        super().__init__()
        self.proxy = proxy

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        proxy = self.proxy
        proxy.stats.connections += 1
        now = proxy.loop.time()
        pending: collections.deque = collections.deque()
        up = Direction(proxy, proxy.up_bucket, HttpTap(proxy.stats, True, pending), now + proxy.cfg.rtt_s, False)
        down = Direction(proxy, proxy.down_bucket, HttpTap(proxy.stats, False, pending), 0.0, True)
        up.src = self.transport
        down.dst = self.transport
        self.inbound, self.outbound = up, down
        self._closed_dirs = 0

        def closed() -> None:
            self._closed_dirs += 1
            if self._closed_dirs == 2:
                for side in (self, self.peer):
                    if side is not None and side.transport is not None:
                        side.transport.close()

        up.on_closed = closed  # type: ignore[method-assign]
        down.on_closed = closed  # type: ignore[method-assign]
        self.transport.pause_reading()  # type: ignore[union-attr]
        proxy.loop.create_task(self._connect())

    async def _connect(self) -> None:
        proxy = self.proxy
        try:
            _, origin = await proxy.loop.create_connection(_Side, *proxy.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        assert isinstance(origin, _Side)
        if self.lost:
            origin.transport.close()  # type: ignore[union-attr]
            return
        origin.peer, self.peer = self, origin
        origin.inbound, origin.outbound = self.outbound, self.inbound
        assert self.inbound is not None and self.outbound is not None
        self.inbound.dst = origin.transport
        self.outbound.src = origin.transport
        self.inbound._arm()
        self.transport.resume_reading()  # type: ignore[union-attr]


class Proxy:
    def __init__(self, upstream: tuple[str, int], cfg: LinkConfig, loop: asyncio.AbstractEventLoop):
        self.upstream = upstream
        self.cfg = cfg
        self.loop = loop
        self.stats = Stats()
        self.up_bucket = TokenBucket(cfg.total_rate)  # client -> origin
        self.down_bucket = TokenBucket(cfg.total_rate)  # origin -> client

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode()
            method, path, _ = line.split(" ", 2)
            if method == "POST" and path == "/reset":
                self.stats = Stats()
                body = b'{"reset": true}'
            else:
                body = json.dumps(self.stats.snapshot()).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        finally:
            writer.close()


async def serve(args: argparse.Namespace) -> None:
    cfg = LinkConfig(
        rtt_s=args.rtt_ms / 1000.0,
        total_rate=args.bandwidth_MBps * 1e6,
        conn_rate=args.conn_bandwidth_MBps * 1e6,
        window=args.window_bytes,
        max_queue_s=args.max_queue_ms / 1000.0,
    )
    loop = asyncio.get_running_loop()
    proxy = Proxy((args.upstream_host, args.upstream_port), cfg, loop)
    server = await loop.create_server(lambda: _ClientSide(proxy), "127.0.0.1", args.listen_port, backlog=512)
    ctl = await asyncio.start_server(proxy.control, "127.0.0.1", args.control_port)
    port = server.sockets[0].getsockname()[1]
    cport = ctl.sockets[0].getsockname()[1]
    info = {"ready": True, "port": port, "control_port": cport, "pid": os.getpid(), "loop": type(loop).__module__}
    print(json.dumps(info), flush=True)
    stop = asyncio.Event()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    ctl.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream-host", default="127.0.0.1")
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--rtt-ms", type=float, default=70.0)
    p.add_argument("--bandwidth-MBps", type=float, default=150.0, help="total per direction, MB/s (1e6), 0=off")
    p.add_argument("--conn-bandwidth-MBps", type=float, default=150.0, help="per connection, MB/s, 0=off")
    p.add_argument("--window-bytes", type=int, default=16 << 20)
    p.add_argument("--max-queue-ms", type=float, default=20.0)
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="asyncio")
    args = p.parse_args(argv)
    if args.upstream_host not in ("127.0.0.1", "localhost", "::1"):
        p.error("the emulator only forwards to loopback")
    if args.loop == "uvloop" or (args.loop == "auto" and _have_uvloop()):
        import uvloop

        uvloop.run(serve(args))
    else:
        asyncio.run(serve(args))


def _have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- client side
class WanLink:
    """Start ``python -m benchmarks.wan`` as a subprocess (context manager)."""

    def __init__(
        self,
        upstream_port: int,
        rtt_ms: float,
        bandwidth_MBps: float,
        conn_bandwidth_MBps: float,
        window_bytes: int = 16 << 20,
        max_queue_ms: float = 20.0,
        log_path: str | None = None,
        loop: str = "asyncio",
    ):
        self.args = [
            sys.executable,
            "-m",
            "benchmarks.wan",
            f"--upstream-port={upstream_port}",
            f"--rtt-ms={rtt_ms}",
            f"--bandwidth-MBps={bandwidth_MBps}",
            f"--conn-bandwidth-MBps={conn_bandwidth_MBps}",
            f"--window-bytes={window_bytes}",
            f"--max-queue-ms={max_queue_ms}",
            f"--loop={loop}",
        ]
        self.rtt_ms = rtt_ms
        self.bandwidth_MBps = bandwidth_MBps
        self.conn_bandwidth_MBps = conn_bandwidth_MBps
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.control_port = 0

    def start(self) -> WanLink:
        from pathlib import Path

        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        err = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        if self.log_path:
            err.close()  # type: ignore[union-attr]
        assert self.proc.stdout is not None
        try:
            line = self.proc.stdout.readline()
        except BaseException:  # interrupted while it started (SIGTERM, Ctrl-C): stop it first
            self.stop()
            raise
        if not line:
            self.stop()
            raise RuntimeError("WAN emulator failed to start")
        info = json.loads(line)
        self.port, self.control_port = info["port"], info["control_port"]
        self.loop_impl = info.get("loop", "")
        return self

    def stop(self) -> None:
        from benchmarks.util import terminate

        if self.proc is not None:
            terminate(self.proc, timeout=5)
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> WanLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _control(self, method: str, path: str) -> dict[str, Any]:
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.control_port, timeout=30)
        try:
            c.request(method, path)
            return json.loads(c.getresponse().read())
        finally:
            c.close()

    def stats(self) -> dict[str, Any]:
        return self._control("GET", "/stats")

    def reset(self) -> None:
        self._control("POST", "/reset")


if __name__ == "__main__":
    main()
