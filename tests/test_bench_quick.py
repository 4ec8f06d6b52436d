"""The benchmark harness's quick mode, so it cannot rot.

Runs ``python -m benchmarks.run --quick`` (tiny data, RTT 20 ms, 2 epochs)
and checks real outcomes: every system/link/dataset produced a per-second
series with samples, every epoch read exactly the dataset's bytes, the WAN
emulator counted the GETs and the unique bytes, and the outputs have the
expected keys. No wall-clock assertions.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402
from benchmarks.util import fuse_usable  # noqa: E402
from benchmarks.wan import HttpTap, Stats, TokenBucket  # noqa: E402

pytest.importorskip("torch", reason="the benchmark reader needs torch (pip install torch==2.13.0)")

FUSE_OK, FUSE_WHY = fuse_usable()
needs_fuse = pytest.mark.skipif(not FUSE_OK, reason=f"FUSE unusable: {FUSE_WHY}")


# ---------------------------------------------------------------- helpers
def _leftovers(marker: str) -> tuple[list[str], list[str]]:
    """Mounts and processes whose paths contain ``marker`` (our tmp dir)."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f if marker in line]
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            procs.append(f"{pid}: {cmd[:200]}")
    return mounts, procs


def _run_quick(tmp_path: Path, systems: str, datasets: str | None = None) -> tuple[dict, dict, Path]:
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--systems", systems, "--workdir", str(work)]
    if datasets is not None:
        cmd += ["--datasets", datasets]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-4000:]}\nSTDERR:\n{r.stderr[-4000:]}"
    out = work / "quick"
    summary = json.loads((out / "summary.json").read_text())
    series = json.loads((out / "series.json").read_text())
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind: {mounts} {procs}"
    return summary, series, out


def _check(summary: dict, series: dict, out: Path, systems: list[str],
           datasets: tuple[str, ...] = ("images", "images-inorder", "shards")) -> None:
    for key in ("command", "machine", "versions", "params", "selfcheck", "runs", "failures", "skipped"):
        assert key in summary, key
    assert summary["failures"] == []
    assert summary["selfcheck"]["origin_direct"]["MBps"] > 0
    assert summary["selfcheck"]["through_remote"]["proxy_get_count"] > 0
    runs = {(m["dataset"], m["link"], m["system"]): m for m in summary["runs"]}
    expected = set()
    for ds in datasets:
        for s in systems:
            for link in ["local"] if s == "local" else ["colocated", "remote"]:
                expected.add((ds, link, s))
    assert expected <= set(runs), f"missing runs: {expected - set(runs)}"
    for key in expected:
        m = runs[key]
        for k in ("first_epoch_s", "later_epoch_s", "steady", "warmup_s", "warmup_bound_s", "epochs", "dataset_bytes"):
            assert k in m, (key, k)
        # every epoch read exactly the dataset (bytes and samples)
        assert len(m["epochs"]) == 2, key
        assert all(e["complete"] for e in m["epochs"]), (key, m["epochs"])
        s = series["/".join(key)]
        assert sum(p["samples_per_s"] for p in s["series"]) == 2 * m["dataset_samples"], key
        assert abs(sum(p["MBps"] for p in s["series"]) * 1e6 - 2 * m["dataset_bytes"]) < 1e3 * len(s["series"]), key
        if key[2] != "local":
            # the emulator saw the GETs, and every byte crossed the link at least once
            assert m["get_count"] > 0, key
            assert m["unique_bytes"] == m["dataset_bytes"], key
            assert m["get_bytes"] >= m["unique_bytes"], key
            assert m["daemon_cpu_s"] is not None and m["daemon_peak_rss"] > 0, key
        if key[1] == "remote":
            assert m["steady_ratio"] > 0, key
            assert m["warmup_bound_s"] > 0, key
        if key[2].startswith("cachefs"):
            cm = m.get("cachefs_metrics") or {}
            assert cm.get("s3_get_requests"), f"cachefs /metrics had no GET count: {cm}"
            assert cm.get("prefetch_unused_fraction") is not None or not cm.get("prefetch_issued_bytes"), cm
    text = (out / "RESULTS.md").read_text()
    assert "| dataset | system | link |" in text
    assert "| target | measured on | value | |" in text and "GET bytes <= 1.02x unique bytes" in text
    assert (out / "throughput.png").stat().st_size > 1000
    assert (out / "series.csv").read_text().startswith("dataset,link,system,second,samples_per_s,MBps")


# ---------------------------------------------------------------- tests
@pytest.mark.drops_caches
@needs_fuse
def test_quick_cachefs_and_local(tmp_path: Path) -> None:
    # One dataset of each kind: images-inorder is images in another order (the same code
    # paths of the harness), and a third of this test's time.
    summary, series, out = _run_quick(tmp_path, "cachefs,local", "images,shards")
    _check(summary, series, out, ["cachefs", "local"], ("images", "shards"))


@pytest.mark.drops_caches
@pytest.mark.slow
@needs_fuse
def test_quick_all_peers(tmp_path: Path) -> None:
    # cachefs and local disk are run on every dataset by test_quick_cachefs_and_local: the
    # peers and the hinted cachefs here, on one dataset (every system on every dataset took
    # a sixth of the suite's time; what is checked here is that each peer runs and reports)
    systems = ["cachefs-hint", "rclone", "s3fs"]
    summary, series, out = _run_quick(tmp_path, ",".join(systems), "images")
    for s, why in summary["skipped"].items():
        pytest.fail(f"peer {s} not installed: {why}")
    _check(summary, series, out, systems, ("images",))


@pytest.mark.drops_caches
@needs_fuse
def test_ctrl_c_tears_everything_down(tmp_path: Path) -> None:
    work = tmp_path / "work"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--quick",
        "--systems",
        "cachefs",
        "--datasets",
        "images",
        "--workdir",
        str(work),
    ]
    # SIGINT as a terminal delivers it, even when this test runs in a background job
    # (which starts with SIGINT ignored, and Python keeps an ignored SIGINT ignored).
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            mounts, _ = _leftovers(str(tmp_path))
            if mounts:
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"run ended before a mount appeared:\n{proc.stdout.read() if proc.stdout else ''}"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind after Ctrl-C: {mounts} {procs}"


def test_http_tap_counts_gets_ranges_and_chunked_bodies() -> None:
    st = Stats()
    pending: collections.deque = collections.deque()
    rq, rs = HttpTap(st, True, pending), HttpTap(st, False, pending)
    reqs = (
        b"GET /bkt/a/b.jpg HTTP/1.1\r\nHost: x\r\nRange: bytes=10-19\r\n\r\n"
        b"HEAD /bkt/a/c.jpg HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /bkt?list-type=2&prefix=a HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /bkt/a/b.jpg HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    resps = (
        b"HTTP/1.1 206 Partial\r\nContent-Range: bytes 10-19/100\r\nContent-Length: 10\r\n\r\n0123456789"
        b"HTTP/1.1 200 OK\r\nContent-Length: 555\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3;x=1\r\nabc\r\n0\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    )
    for data, tap in ((reqs, rq), (resps, rs)):
        for i in range(0, len(data), 7):  # split headers and bodies across reads
            tap.feed(data[i : i + 7])
    s = st.snapshot()
    assert s["requests"] == {"GET": 2, "HEAD": 1, "LIST": 1}
    assert s["get_requested_bytes"] == 110 and s["get_transferred_bytes"] == 110
    assert s["unique_bytes"] == 100  # bytes 10-19 were fetched twice
    assert s["unparsed_connections"] == 0


def test_token_bucket_serialises_at_rate() -> None:
    b = TokenBucket(rate=1e6, burst=0)
    done = [b.reserve(100_000, now=0.0) for _ in range(10)]
    assert done[-1] == pytest.approx(1.0)


def test_warmup_detection() -> None:
    reader = {
        "epochs": [{"start": 0, "end": 10}, {"start": 11, "end": 16}],
        "series": [[s, 10 if s < 6 else 100, 0] for s in range(10)]
        + [[10, 0, 0]]
        + [[s, 100, 0] for s in range(11, 16)],
    }
    assert report.warmup_time(reader, 100.0) == 6.0
    assert report.warmup_time(reader, 1000.0) is None


@pytest.mark.drops_caches
@needs_fuse
def test_smallfiles_quick_reports_cost_per_file_and_the_rigs_cores(tmp_path: Path) -> None:
    """``python -m benchmarks.smallfiles --quick`` (120 files): every pass read every file;
    cachefs's rows carry the per-file breakdown and the cores of each rig process."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.smallfiles", "--quick", "--systems", "cachefs,local",
           "--passes", "cold,warm", "--json", str(out), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = {(row["system"], row["pass"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("cachefs", "cold"), ("cachefs", "warm"), ("local", "warm")}
    for row in rows.values():
        assert row["files"] == 120 and row["files_per_s"] > 0
        assert row["cores_by_process"]["readers"] >= 0
    cold, warm = rows["cachefs", "cold"], rows["cachefs", "warm"]
    assert cold["s3_gets_per_file"] == 1.0 and warm["s3_gets_per_file"] == 0.0
    assert cold["fuse_per_file"]["open"] == 1.0 and cold["cpu_us_per_file"] > 0
    # the cold pass went through the origin and the emulator
    assert cold["cores_by_process"]["origin"] > 0 and cold["cores_by_process"]["emulator"] > 0
    assert cold["cores_by_process"]["daemon"] > 0
    assert "| host busy; cores by process |" in r.stdout
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind: {mounts} {procs}"


@needs_fuse
def test_randomreads_quick_reads_exact_pieces_and_counts_the_link(tmp_path: Path) -> None:
    """``python -m benchmarks.randomreads --quick``: every piece read is compared with the
    object (a wrong one fails the run); the direct baseline moves each piece once; with
    4 MiB blocks most random reads are answered as pieces, not whole blocks (60 reads of
    64 KB in 64 blocks of 4 MiB would move ~60 blocks: ~60 bytes per byte read)."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.randomreads", "--quick", "--systems", "cachefs",
           "--block-sizes", "4M,64K", "--json", str(out), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"direct", "cachefs 4M", "cachefs 64K"}
    read = 60 * 64 * 1024
    per_byte = {name: row["link_bytes"] / read for name, row in rows.items()}
    assert 0.99 <= per_byte["direct"] <= 1.01, per_byte
    assert per_byte["cachefs 64K"] >= 1.0, per_byte  # (every piece crossed the link once)
    assert per_byte["cachefs 4M"] < 30, per_byte
    assert rows["cachefs 4M"]["piece_reads"] >= 30, rows["cachefs 4M"]
    assert rows["cachefs 64K"]["piece_reads"] == 0  # (a 64 KB read is a 64K block's share)
    assert rows["cachefs 4M"]["daemon_cpu_s"] > 0
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind: {mounts} {procs}"


@pytest.mark.drops_caches
@needs_fuse
@pytest.mark.parametrize("access", ["seq", "mmap", "mmap-each"])
def test_largefile_quick_reads_exact_bytes_every_epoch(tmp_path: Path, access: str) -> None:
    """``python -m benchmarks.largefile --quick``: every epoch of every system (local disk,
    cachefs with and without passthrough; cold, warm, after a restart over the same cache)
    read exactly the object (a wrong byte fails the run), the cold epochs through the
    daemon, and the table is printed."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.largefile", "--quick", "--access", access,
           "--json", str(out), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = {(row["system"], row["epoch"]): row for row in json.loads(out.read_text())["rows"]}
    systems = ("local", "cachefs", "cachefs-nopt")
    assert set(rows) == {(s, e) for s in systems for e in ("cold", "warm", "restarted")}
    for system in ("cachefs", "cachefs-nopt"):
        assert rows[(system, "cold")]["fuse_reads"] > 0, rows[(system, "cold")]
        assert rows[(system, "cold")]["daemon_cpu_s"] >= 0
    assert "| system | epoch | seconds | MB/s | vs local |" in r.stdout
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind: {mounts} {procs}"


@pytest.mark.drops_caches
@needs_fuse
def test_restart_benchmark_runs_and_leaves_nothing(tmp_path: Path) -> None:
    """``python -m benchmarks.restart`` on a small object: a cold read, a restart over the
    same cache, and warm passes, each reported with its rate and the daemon's CPU, and
    nothing left mounted or running."""
    cmd = [sys.executable, "-m", "benchmarks.restart", "--size-mib", "8", "--passes", "2",
           "--workdir", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["passes"]) == 2
    assert all(p["MBps"] > 0 and p["daemon_cpu_s"] >= 0 for p in out["passes"]), out
    mounts, procs = _leftovers(str(tmp_path))
    assert not mounts and not procs, f"left behind: {mounts} {procs}"


def _processes_naming(text: str) -> list[int]:
    """Pids whose command line contains ``text``."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _mounted_under(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return str(path) in f.read()


@pytest.mark.drops_caches
@pytest.mark.parametrize("when", ["origin starting", "mounted"])
def test_smallfiles_stopped_by_sigterm_leaves_no_server_or_mount(tmp_path: Path, when: str) -> None:
    """SIGTERM in the middle of a run (an operator's kill, a CI timeout) stops the origin,
    the emulator and the mount it started, like Ctrl-C; the default action left the
    origin (its own session) running, and so did an interrupt while it started."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.smallfiles", "--quick", "--systems", "cachefs,local",
           "--passes", "cold,warm", "--workdir", str(work)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        ready = ((lambda: bool(_processes_naming(f"{work}/s3"))) if when == "origin starting"
                 else (lambda: _mounted_under(work)))
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, f"never {when}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while _processes_naming(str(work)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in _processes_naming(str(work))}
    assert left == {}, "a process of the run outlived it"
    assert not _mounted_under(work)


def test_a_weed_that_did_not_shut_down_cleanly_leaves_no_socket_behind(tmp_path: Path) -> None:
    """weed keeps a unix socket per gRPC server in the temp directory, named by port; a weed
    killed (SIGKILL after the stop timeout, a crash) left them there, hundreds after a day
    of benchmarks: stop() removes this start's."""
    from benchmarks.origin import SeaweedOrigin

    origin = SeaweedOrigin(tmp_path / "weed").start()
    try:
        sockets = origin.grpc_sockets()
        assert any(p.exists() for p in sockets), sockets  # (where weed puts them)
        assert origin.proc is not None
        os.killpg(origin.proc.pid, signal.SIGKILL)  # no clean shutdown
        origin.proc.wait(30)
        assert any(p.exists() for p in sockets)
    finally:
        origin.stop()
    assert not [p for p in sockets if p.exists()]
