"""Shared fixtures: a real S3-compatible server (moto) on loopback and real FUSE mounts.

Mount tests run the daemon exactly as users do (``python -m cachefs mount``
without --foreground, which returns once the mount is live) and always
lazy-unmount in teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

ACCESS_KEY = "testing"
SECRET_KEY = "testing-secret"


def in_ci() -> bool:
    """CI sets CI=true: there a missing prerequisite is a failure, never a skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI, turn every skip (a missing /dev/fuse, tool or library, or a kernel without
    FUSE passthrough) into a failure that says what was missing: a machine without FUSE must
    not pass the suite with its real-mount layer silently skipped."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which requires every prerequisite: {reason}"


def fuse_unusable_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


requires_fuse = pytest.mark.skipif(fuse_unusable_reason() is not None,
                                   reason=fuse_unusable_reason() or "")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the whole session."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Credentials for the test server, and no real AWS configuration leaking in."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    empty = tmp_path_factory.getbasetemp() / "no-aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("CACHEFS_RUNTIME_DIR", str(tmp_path_factory.getbasetemp() / "run"))
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)


def s3_client(endpoint: str) -> Any:
    import boto3
    import botocore.config

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        config=botocore.config.Config(request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[tuple[Any, str]]:
    """A fresh bucket; yields (client, name)."""
    client = s3_client(s3_endpoint)
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield client, name


def read_unbuffered(path: Path) -> bytes:
    """A whole file with one open and unbuffered reads (what a data loader's open costs)."""
    with open(path, "rb", buffering=0) as f:
        return f.read()


# -- tests in parallel (pytest-xdist) and the machine's page cache --------------------------------
# Under pytest-xdist (`-n 2`, the default in pyproject.toml) tests run two at a time in worker
# processes. Dropping the page cache, dentries and inodes is the machine's, not a test's: a
# drop in one test would turn another's "the kernel answers this from its cache" (a resident
# page, a remembered name) into a request its daemon counts. So every test that drops them
# (marked ``drops_caches``; the benchmarks' runs drop them too) runs while no other test
# does: it holds a lock exclusively that every other test holds shared. A turnstile lock in
# front keeps a waiting exclusive test from being passed by a stream of shared ones.
# (ALONE, in the environment: the test modules import this file as tests.conftest, a second
# copy of its globals.)
ALONE = "CACHEFS_TESTS_RUN_ALONE"


def _under_xdist() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(autouse=True)
def _page_cache_lock(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if not _under_xdist():
        yield
        return
    run_dir = tmp_path_factory.getbasetemp().parent  # the workers' basetemps are in it
    exclusive = request.node.get_closest_marker("drops_caches") is not None
    with open(run_dir / "page-cache.turnstile", "a") as turnstile, \
            open(run_dir / "page-cache.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        if exclusive:
            os.environ[ALONE] = "1"
        try:
            yield
        finally:
            os.environ.pop(ALONE, None)
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` pytest-xdist sends the tests of one ``xdist_group`` to one
    worker by suffixing their ids with ``@group`` at collection. Tests share a group because
    they must not run at once (``make dist`` and ``make image`` build in the checkout) or
    share one costly setup: if the suffix did not take (a pytest that reads ids elsewhere),
    they would run two at a time, so each fails here instead."""
    if (_under_xdist() and item.config.getoption("loadgroup", default=False)
            and item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid):
        pytest.fail("pytest-xdist did not group this test (--dist loadgroup): this pytest and "
                    "pytest-xdist do not work together (see pyproject.toml); -n 0 runs serially",
                    pytrace=False)


def send_slowly(server: socket.socket, pieces: list[bytes], gap: float) -> threading.Thread:
    """Send ``pieces`` on ``server`` from a daemon thread, ``gap`` seconds apart (an answer
    arriving in segments, or stalling between them); returns the thread."""
    def run() -> None:
        for piece in pieces:
            server.sendall(piece)
            time.sleep(gap)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def drop_page_cache(what: int = 3) -> None:
    """Drop the page cache, dentries and inodes (``what`` 3; 2: dentries and inodes only):
    the next reads and lookups go to the file systems. The test must be marked
    ``drops_caches`` (see above)."""
    assert os.environ.get(ALONE) == "1" or not _under_xdist(), \
        "a test that drops the page cache must be marked @pytest.mark.drops_caches"
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(f"{what}\n")


def drop_cached(path: Path) -> None:
    """Write ``path`` back and drop its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path, offset: int, size: int) -> int:
    """Bytes of ``[offset, offset+size)`` in the page cache (``mincore``: it looks without
    reading, unlike a read that may not wait, which starts the kernel's readahead)."""
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, pages * page, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, pages * page, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(page for b in vec.raw if b & 1)
        finally:
            libc.munmap(addr, pages * page)
    finally:
        os.close(fd)


def reread_cold(path: Path, data: bytes, offsets: tuple[int, ...], rounds: int = 2) -> None:
    """``rounds`` times: drop the page cache, then read ``path`` whole and 100 bytes at each
    offset (random offsets, not only sequential); every byte must be ``data``'s."""
    for _ in range(rounds):
        drop_page_cache()
        assert read_unbuffered(path) == data
        with open(path, "rb", buffering=0) as f:
            for off in offsets:
                assert os.pread(f.fileno(), 100, off) == data[off:off + 100]


def scrape(addr: str) -> dict[str, float]:
    """Samples of a cachefs /metrics endpoint as {'name{label="v"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    """The resident set size of process ``pid``, in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def run_cachefs(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
                preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, preexec_fn=preexec_fn)


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


class Mount:
    """A running cachefs mount started through the CLI."""

    def __init__(self, source: str, mountpoint: Path, cache_dir: Path, endpoint: str,
                 extra: list[str]) -> None:
        self.source = source
        self.path = mountpoint
        self.cache_dir = cache_dir
        self.endpoint = endpoint
        self.extra = extra
        self.metrics_addr = ""  # HOST:PORT the daemon serves its metrics on, once started
        # Run in the mount command's process before it starts (the daemon inherits it).
        self.preexec_fn: Callable[[], None] | None = None

    def start(self) -> None:
        # Port 0: the daemon binds a free port itself and registers which (a port found
        # free here may be taken by the other test worker's process before it binds).
        proc = run_cachefs("mount", self.source, str(self.path), "--cache-dir",
                           str(self.cache_dir), "--endpoint-url", self.endpoint,
                           "--metrics-addr", "127.0.0.1:0", *self.extra,
                           preexec_fn=self.preexec_fn)
        if proc.returncode != 0:
            log = self.cache_dir / "cachefs.log"
            tail = log.read_text()[-4000:] if log.exists() else ""
            raise AssertionError(f"mount failed ({proc.returncode}): {proc.stderr}\n{tail}")
        assert is_mounted(self.path)
        self.metrics_addr = self._served_metrics_addr()

    def _served_metrics_addr(self) -> str:
        """The metrics address the daemon registered (its status snapshot, written before
        the mount is ready, or by its maintenance loop within a second)."""
        from cachefs.control import registry

        deadline = time.monotonic() + 30
        while True:
            entry = registry.lookup(self.path) or {}
            if entry.get("metrics_addr"):
                return str(entry["metrics_addr"])
            assert time.monotonic() < deadline, f"no metrics address registered: {entry}"
            time.sleep(0.05)

    def stop(self) -> None:
        if is_mounted(self.path):
            proc = run_cachefs("unmount", str(self.path))
            if proc.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        deadline = time.monotonic() + 30
        while is_mounted(self.path) and time.monotonic() < deadline:
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_addr)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def gets(self) -> float:
        return self.metric('cachefs_s3_requests_total{op="get"}')

    def cache_bytes_on_disk(self) -> int:
        """Bytes the cache's object files take on disk (holes not counted)."""
        return sum(f.stat().st_blocks * 512 for f in (self.cache_dir / "objects").rglob("*")
                   if f.is_file())

    def log(self) -> str:
        p = self.cache_dir / "cachefs.log"
        return p.read_text() if p.exists() else ""

    def corrupt_cache_file(self, offset: int) -> None:
        """Stop the daemon, flip one bit at ``offset`` of its only cache file, start again."""
        self.stop()
        (cache_file,) = [f for f in (self.cache_dir / "objects").rglob("*") if f.is_file()]
        raw = bytearray(cache_file.read_bytes())
        raw[offset] ^= 0x40
        cache_file.write_bytes(bytes(raw))
        self.start()


@pytest.fixture
def mount_factory(tmp_path: Path, s3_endpoint: str) -> Iterator[Any]:
    """Create mounts of s3://bucket/prefix; every one is unmounted at teardown."""
    reason = fuse_unusable_reason()
    if reason:
        pytest.skip(reason)
    mounts: list[Mount] = []

    def make(source: str, *extra: str, cache_dir: Path | None = None,
             start: bool = True) -> Mount:
        mp = tmp_path / f"mnt{len(mounts)}"
        mp.mkdir()
        m = Mount(source, mp, cache_dir or tmp_path / f"cache{len(mounts)}", s3_endpoint,
                  list(extra))
        mounts.append(m)
        if start:
            m.start()
        return m

    yield make
    for m in mounts:
        try:
            m.stop()
        finally:
            if is_mounted(m.path):
                subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=False)


@contextlib.asynccontextmanager
async def running(*services: Any) -> AsyncIterator[None]:
    """Run each service's ``run`` (a Fetcher, a shared tier) in a nursery around the
    block. When the block ends normally each service is drained (``drain()``: its
    writes have landed, so the block's outcome can be checked on disk), then all are
    cancelled; an exception in the block cancels them without draining."""
    async with trio.open_nursery() as nursery:
        for service in services:
            await nursery.start(service.run)
        try:
            yield
            for service in services:
                await service.drain()
        finally:
            nursery.cancel_scope.cancel()


class DaemonHolds:
    """Failpoints of a daemon under test (cachefs.failpoints), held, released and made to
    raise through files in :attr:`dir`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def hold(self, name: str, *, forget: bool = False) -> None:
        """Hold the threads that reach ``name``; ``forget``: a reach before this does not
        count for :meth:`wait`."""
        if forget:
            (self.dir / f"{name}.reached").unlink(missing_ok=True)
        (self.dir / f"{name}.hold").touch()

    def wait(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dir / f"{name}.reached").exists():
            assert time.monotonic() < deadline, f"the daemon did not reach {name}"
            time.sleep(0.01)

    def release(self, name: str) -> None:
        (self.dir / f"{name}.hold").unlink(missing_ok=True)


def daemon_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> DaemonHolds:
    """Arm failpoints ``names`` in the daemons this test starts from now on."""
    d = tmp_path / "failpoints"
    d.mkdir()
    monkeypatch.setenv("CACHEFS_FAILPOINTS", ",".join(names))
    monkeypatch.setenv("CACHEFS_FAILPOINT_DIR", str(d))
    return DaemonHolds(d)
