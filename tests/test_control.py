"""The control server in-process: hostile and broken clients never end it, requests are
bounded, only root and the mounting user are served, long hints arrive in chunks."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs import metrics
from cachefs.control import client, server
from cachefs.control.server import ControlServer
from cachefs.control.warm import WarmProgress
from cachefs.errors import CachefsError


class FakeOrder:
    """Stands for ReadOrder: records the orders it is given."""

    def __init__(self) -> None:
        self.orders: list[list[str]] = []
        self.fail = False
        self.pending = 0

    def set_order(self, keys: list[str]) -> int:
        if self.fail:
            raise RuntimeError("bug in the read order")
        self.orders.append(list(keys))
        return len(keys)


class FakeWarmer:
    """Stands for Warmer: reports progress every few milliseconds until released."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.cancelled = False
        self.paths: list[str] = []

    async def warm(self, paths: list[str], *, parallel: int, check: bool,
                   on_progress: Callable[[WarmProgress], Awaitable[None]]) -> WarmProgress:
        self.paths = list(paths)
        self.started.set()
        progress = WarmProgress()
        try:
            while not self.release.is_set():
                await on_progress(progress)
                await trio.sleep(0.005)
        except trio.Cancelled:
            self.cancelled = True
            raise
        return progress


def counter(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels or None)
    return value or 0.0


def rejected(reason: str) -> float:
    return counter("cachefs_control_rejected_total", reason=reason)


def control_errors() -> float:
    return counter("cachefs_background_errors_total", task="control")


def serve(tmp_path: Path, body: Callable[[ControlServer, Path], Awaitable[None]],
          **kwargs: Any) -> ControlServer:
    """Run a ControlServer while ``body`` runs; fail if the server ends on its own."""
    path = tmp_path / "run" / "c.sock"
    ctl = ControlServer(path, read_order=kwargs.pop("read_order", FakeOrder()),  # type: ignore[arg-type]
                        warmer=kwargs.pop("warmer", FakeWarmer()),  # type: ignore[arg-type]
                        root_prefix="ds/", **kwargs)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ctl.serve)
            with trio.fail_after(60):
                await body(ctl, path)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return ctl


async def exchange(path: Path, data: bytes, *, close_write: bool = True) -> list[dict[str, Any]]:
    """Send raw bytes; return the JSON lines the server answers before it closes."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        try:
            await stream.send_all(data)
            if close_write:
                await stream.send_eof()
        except trio.BrokenResourceError:
            pass
        received = b""
        try:
            while chunk := await stream.receive_some(1 << 16):
                received += chunk
        except trio.BrokenResourceError:
            pass
    return [json.loads(line) for line in received.splitlines()]


async def status_works(path: Path) -> None:
    replies = await exchange(path, b'{"op": "status"}\n')
    assert replies and replies[0]["event"] == "status"


def test_junk_from_a_client_that_hangs_up_at_once_does_not_end_the_server(tmp_path):
    # The error reply's send fails (the client is gone): that used to end the daemon.
    async def body(ctl: ControlServer, path: Path) -> None:
        for _ in range(50):
            sock = trio.socket.socket(trio.socket.AF_UNIX)
            await sock.connect(str(path))
            await sock.send(b"junk\n")
            sock.close()
        await trio.sleep(0.1)
        await status_works(path)

    before = control_errors()
    serve(tmp_path, body)
    assert control_errors() == before  # a client hanging up is no error of the daemon


@pytest.mark.parametrize("data,fragment", [
    (b"\x00\xff\xfe garbage \x01\n", "not JSON"),
    (b'{"op": "hint", "paths": ["a", "b"\n', "not JSON"),
    (b'{"op": "hint", "paths": ["a", "b"', "middle of a request"),
    (b'["op", "status"]\n', "JSON object"),
    (b'{"op": "format-disk"}\n', "unknown op"),
    (b'{"op": 7}\n', "unknown op"),
    (b'{"op": "hint", "paths": "abc"}\n', "list of strings"),
    (b'{"op": "hint", "paths": [1, 2]}\n', "list of strings"),
    (b'{"op": "hint", "paths": ["a"], "append": "yes"}\n', "'append'"),
    (b'{"op": "warm", "parallel": "16"}\n', "'parallel'"),
    (b'{"op": "warm", "parallel": [1]}\n', "'parallel'"),
    (b'{"op": "warm", "parallel": 100000}\n', "between 1 and 1024"),
    (b'{"op": "warm", "check": 1}\n', "'check'"),
    (b"[" * 200_000 + b"\n", "not JSON"),
])
def test_malformed_requests_get_an_error_reply(tmp_path, data, fragment):
    async def body(ctl: ControlServer, path: Path) -> None:
        replies = await exchange(path, data)
        assert len(replies) == 1 and replies[0]["event"] == "error", replies
        assert fragment in replies[0]["message"]
        await status_works(path)

    before = rejected("malformed")
    serve(tmp_path, body)
    assert rejected("malformed") == before + 1


def test_a_huge_line_without_newline_is_cut_off_at_the_line_limit(tmp_path):
    async def body(ctl: ControlServer, path: Path) -> None:
        stream = await trio.open_unix_socket(str(path))
        sent = 0
        async with stream:
            try:
                block = b"x" * (1 << 20)
                while sent < 200 << 20:  # the server stops reading long before this
                    await stream.send_all(block)
                    sent += len(block)
            except trio.BrokenResourceError:
                pass
        assert sent <= 8 << 20, sent  # the socket buffers, then the server hangs up
        await status_works(path)

    before = rejected("too_large")
    serve(tmp_path, body)
    assert rejected("too_large") == before + 1


def test_a_slow_client_is_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "LINE_TIMEOUT", 0.3)

    async def body(ctl: ControlServer, path: Path) -> None:
        with trio.fail_after(10):
            replies = await exchange(path, b'{"op": "sta', close_write=False)
        assert replies[0]["event"] == "error" and "no complete request" in replies[0]["message"]
        await status_works(path)

    before = rejected("timeout")
    serve(tmp_path, body)
    assert rejected("timeout") == before + 1


def test_connections_are_bounded_and_extra_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(server, "CONNECT_WAIT", 0.2)

    async def body(ctl: ControlServer, path: Path) -> None:
        idle = [await trio.open_unix_socket(str(path)) for _ in range(3)]
        await trio.sleep(0.1)
        replies = await exchange(path, b'{"op": "status"}\n')
        assert replies[0]["event"] == "error" and "busy" in replies[0]["message"]
        await idle[0].aclose()  # a slot frees: the next client is served
        await trio.sleep(0.05)
        await status_works(path)
        for s in idle[1:]:
            await s.aclose()

    before = rejected("busy")
    serve(tmp_path, body)
    assert rejected("busy") == before + 1


def test_peers_other_than_root_and_the_mounting_user_are_refused(tmp_path):
    order = FakeOrder()

    async def body(ctl: ControlServer, path: Path) -> None:
        replies = await exchange(path, b'{"op": "hint", "paths": ["a"]}\n')
        assert replies == [{"event": "error", "message": replies[0]["message"]}]
        assert "permission denied" in replies[0]["message"]

    before = rejected("peer")
    serve(tmp_path, body, read_order=order, allowed_uids=frozenset({os.geteuid() + 4242}))
    assert rejected("peer") == before + 1
    assert order.orders == []


def test_the_socket_is_private_whatever_the_umask(tmp_path):
    async def body(ctl: ControlServer, path: Path) -> None:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert [p.name for p in path.parent.iterdir()] == ["c.sock"]  # no staging left

    old = os.umask(0)
    try:
        serve(tmp_path, body)
    finally:
        os.umask(old)


def test_a_long_hint_arrives_in_chunks_in_order(tmp_path, monkeypatch):
    order = FakeOrder()
    paths = [f"train/class{i % 1000:04d}/img-{i:07d}.jpg" for i in range(200_000)]

    async def body(ctl: ControlServer, path: Path) -> None:
        def send() -> int:
            replies = list(client.request(path, {"op": "hint", "paths": iter(paths)}))
            return int(replies[0]["accepted"])

        assert await trio.to_thread.run_sync(send) == len(paths)
        assert ctl.pending_bytes == 0

    lines: list[int] = []
    real_send = client._send
    monkeypatch.setattr(client, "_send", lambda s, m: (lines.append(len(json.dumps(m))),
                                                       real_send(s, m))[1])
    serve(tmp_path, body, read_order=order)
    assert order.orders == [["ds/" + p for p in paths]]
    assert len(lines) > 10 and max(lines) < server.MAX_LINE


def test_one_request_line_may_not_exceed_the_limit(tmp_path):
    paths = ["x" * 1000] * 2000  # 2 MB in one line: refused, not buffered

    async def body(ctl: ControlServer, path: Path) -> None:
        line = json.dumps({"op": "hint", "paths": paths}).encode() + b"\n"
        replies = await exchange(path, line)
        assert replies[0]["event"] == "error" and "longer than 1 MiB" in replies[0]["message"]

    serve(tmp_path, body)


def test_pending_chunks_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "MAX_PENDING_BYTES", 100_000)
    order = FakeOrder()

    async def body(ctl: ControlServer, path: Path) -> None:
        def send() -> None:
            list(client.request(path, {"op": "hint", "paths": [f"f{i:06d}" for i in
                                                             range(50_000)]}))

        with pytest.raises(CachefsError, match="too many paths pending"):
            await trio.to_thread.run_sync(send)
        await trio.sleep(0.05)
        assert ctl.pending_bytes == 0  # released with the connection
        await status_works(path)

    monkeypatch.setattr(client, "CHUNK_BYTES", 4096)
    serve(tmp_path, body, read_order=order)
    assert order.orders == []


def test_a_bug_in_a_handler_is_answered_counted_and_survived(tmp_path):
    order = FakeOrder()
    order.fail = True

    async def body(ctl: ControlServer, path: Path) -> None:
        replies = await exchange(path, b'{"op": "hint", "paths": ["a"]}\n')
        assert replies[0]["event"] == "error" and "internal error" in replies[0]["message"]
        order.fail = False
        replies = await exchange(path, b'{"op": "hint", "paths": ["a"]}\n')
        assert replies == [{"event": "ok", "accepted": 1}]

    before = control_errors()
    serve(tmp_path, body, read_order=order)
    assert control_errors() == before + 1


def test_a_warm_client_that_goes_away_cancels_its_job(tmp_path):
    warmer = FakeWarmer()

    async def body(ctl: ControlServer, path: Path) -> None:
        stream = await trio.open_unix_socket(str(path))
        await stream.send_all(b'{"op": "warm", "paths": ["train"]}\n')
        await warmer.started.wait()
        await stream.receive_some(100)
        await stream.aclose()  # Ctrl-C on 'cachefs warm'
        with trio.fail_after(5):
            while not warmer.cancelled:
                await trio.sleep(0.01)
        await status_works(path)

    before = control_errors()
    serve(tmp_path, body, warmer=warmer)
    assert warmer.paths == ["train"] and control_errors() == before


def test_a_warm_client_that_does_not_read_is_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "SEND_TIMEOUT", 0.3)
    warmer = FakeWarmer()

    async def body(ctl: ControlServer, path: Path) -> None:
        stream = await trio.open_unix_socket(str(path))
        await stream.send_all(b'{"op": "warm", "paths": ["train"]}\n')
        with trio.fail_after(20):  # progress fills the socket buffers, then the send times out
            while not warmer.cancelled:
                await trio.sleep(0.05)
        await stream.aclose()
        await status_works(path)

    serve(tmp_path, body, warmer=warmer)


def test_a_control_socket_that_cannot_be_created_does_not_stop_the_daemon(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the runtime directory should be")
    ctl = ControlServer(blocker / "c.sock", read_order=FakeOrder(),  # type: ignore[arg-type]
                        warmer=FakeWarmer(), root_prefix="")  # type: ignore[arg-type]
    before = control_errors()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ctl.serve)  # starts (and ends) without raising

    trio.run(main)
    assert control_errors() == before + 1


def test_the_socket_is_removed_when_the_server_stops(tmp_path):
    async def body(ctl: ControlServer, path: Path) -> None:
        await status_works(path)

    serve(tmp_path, body)  # ends by cancelling the server, as a daemon's shutdown does
    assert list((tmp_path / "run").iterdir()) == []
