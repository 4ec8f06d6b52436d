"""Fuzz the control socket of a live daemon: random bytes, truncated JSON, wrong types,
unknown ops, huge lines without a newline, slow and vanishing clients. Afterwards the
daemon is the same process, the mount reads every byte correctly, and its RSS stayed
bounded."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import rss, run_cachefs
from tests.readers import Readers

pytestmark = pytest.mark.fuse

EVENTS = {"status", "ok", "progress", "done", "error"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20)
paths = st.lists(st.sampled_from(["", "d", "d/f1.bin", "nope", "../x", "/d/f2.bin", "d//f3"])
                 | st.text(max_size=30), max_size=12)
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(["status", "hint", "warm", "rm -rf", ""]) | json_values},
    optional={"paths": paths | json_values, "append": st.booleans() | json_values,
              "parallel": st.integers(-5, 2000) | json_values,
              "check": st.booleans() | json_values})


def _line(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


payloads = st.one_of(
    st.binary(max_size=4096),  # random bytes
    st.binary(max_size=4096).map(lambda b: b + b"\n"),
    requests.map(_line),  # well-formed JSON, any types
    st.tuples(requests, st.floats(0, 1)).map(  # truncated JSON
        lambda t: _line(t[0])[:int(len(_line(t[0])) * t[1])]),
    json_values.map(lambda v: json.dumps(v).encode() + b"\n"),  # not an object
    st.lists(requests.map(_line), min_size=2, max_size=4).map(b"".join),  # pipelined
)


def converse(sock_path: Path, data: bytes, *, hang_up: bool) -> list[dict[str, Any]]:
    """Send ``data``; unless ``hang_up``, half-close and read every reply line."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock_path))
        try:
            s.sendall(data)
            if hang_up:
                return []
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        try:
            while chunk := s.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
    replies = [json.loads(line) for line in received.splitlines()]
    for r in replies:
        assert isinstance(r, dict) and r.get("event") in EVENTS, r
    return replies


def test_control_socket_fuzz_leaves_the_daemon_serving_with_bounded_memory(
        bucket, mount_factory):
    from cachefs.control import registry

    client, name = bucket
    rnd = random.Random(1)
    files = {f"d/f{i}.bin": rnd.randbytes(100_000 + 7 * i) for i in range(6)}
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    m = mount_factory(f"s3://{name}", "--allow-other", "--block-size", "64K")
    for key, data in files.items():
        assert (m.path / key).read_bytes() == data
    st_json = json.loads(run_cachefs("status", "--json", str(m.path)).stdout)
    pid = st_json["pid"]
    sock = registry.control_socket(m.path)
    time.sleep(1)
    rss_before = rss(pid)
    peak = [rss_before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seen: dict[str, int] = {}
    readers = Readers(m.path, files, threads=2).__enter__()  # training goes on meanwhile

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=payloads, hang_up=st.booleans())
    def fuzz(data: bytes, hang_up: bool) -> None:
        for r in converse(sock, data, hang_up=hang_up):
            seen[r["event"]] = seen.get(r["event"], 0) + 1

    try:
        fuzz()

        # Three clients sending 450 MB each without a newline (once 1.6 GB of RSS).
        def flood() -> None:
            block = b"A" * (1 << 20)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(sock))
                try:
                    for _ in range(450):
                        s.sendall(block)
                except (BrokenPipeError, ConnectionResetError):
                    return
            raise AssertionError("the daemon read 450 MB of one request line")

        floods = [threading.Thread(target=flood) for _ in range(3)]
        for t in floods:
            t.start()
        time.sleep(0.2)
        # Slow clients: more connections than the server serves at once, sending nothing.
        idle = []
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            idle.append(s)
        for t in floods:
            t.join(60)
            assert not t.is_alive()
        time.sleep(3)  # the extra connections wait for a slot, then are refused
        for s in idle:
            s.close()
        replies = converse(sock, b'{"op": "status"}\n', hang_up=False)
        assert replies and replies[0]["event"] == "status"
    finally:
        stop.set()
        sampler.join()
        readers.stop()

    assert registry.pid_alive(pid) and json.loads(
        run_cachefs("status", "--json", str(m.path)).stdout)["pid"] == pid
    for key, data in files.items():
        assert (m.path / key).read_bytes() == data
    metrics = m.metrics()
    assert metrics['cachefs_background_errors_total{task="control"}'] == 0
    assert metrics['cachefs_control_rejected_total{reason="malformed"}'] > 50
    assert metrics['cachefs_control_rejected_total{reason="too_large"}'] >= 3
    assert metrics['cachefs_control_rejected_total{reason="busy"}'] >= 1
    assert seen.get("error", 0) > 50 and seen.get("status", 0) >= 1
    growth = peak[0] - rss_before
    print(f"control fuzz: {sum(seen.values())} replies {seen}, RSS {rss_before >> 20} MiB -> "
          f"peak {peak[0] >> 20} MiB, now {rss(pid) >> 20} MiB")
    assert growth < 64 << 20, f"RSS grew by {growth >> 20} MiB"
    assert readers.failed == 0 and readers.wrong_bytes == 0 and readers.ok > 0
    print("FAULT-ROW " + readers.row(
        f"control-socket fuzz: {sum(seen.values())} replies to 300 hostile requests, 3 x 450 MB "
        f"lines, 40 idle connections (RSS peak +{growth >> 20} MiB)", "none needed"))
