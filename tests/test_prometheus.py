"""A real Prometheus scrapes a live cachefs mount; every dashboard query returns data.

The fast check in test_dashboard.py parses the queries; this one runs them. Debian's
``prometheus`` server (installed by ``make deps``) scrapes the daemon's /metrics
every second while a read workload runs (a cold pass that misses and prefetches,
then a pass over the same files with the page cache dropped, answered by the
cache), and then each expression of deploy/grafana/cachefs-dashboard.json is
evaluated through the HTTP API with Grafana's variables filled in. "Data" means
at least one series in the result: what Grafana needs to draw a panel instead of
"No data". A few headline queries must also be non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.test_dashboard import load_dashboard, targets

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

SCRAPE_INTERVAL = "1s"
#: Stands in for Grafana's $__rate_interval: covers the whole workload (and at
#: least four scrapes, as Grafana's own value does).
RATE_WINDOW = "2m"
FILES = 24
FILE_SIZE = 1024 * 1024


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus not installed (Debian package: prometheus; make deps installs it)")
    return path


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


def wait_until(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError as exc:  # server not listening yet
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


def start_prometheus(tmp_path: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL}\n"
        f"  scrape_timeout: {SCRAPE_INTERVAL}\n"
        "scrape_configs:\n"
        "  - job_name: cachefs\n"
        "    static_configs:\n"
        f"      - targets: ['{target}']\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [prometheus_binary(), f"--config.file={config}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def grafana_to_promql(expr: str) -> str:
    """Fill in the dashboard's variables as Grafana would with 'All' selected."""
    return expr.replace('"$instance"', '".+"').replace("$__rate_interval", RATE_WINDOW)


def read_workload(root: Path) -> int:
    """Cold pass (misses, prefetch), then a warm pass with the page cache dropped."""
    total = 0
    for warm in (False, True):
        for i in range(FILES):
            fd = os.open(root / f"f{i:03d}.bin", os.O_RDONLY)
            try:
                if warm:  # the kernel must ask cachefs again, not its page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                while chunk := os.read(fd, 256 * 1024):
                    total += len(chunk)
            finally:
                os.close(fd)
            time.sleep(0.1)  # spread the reads over several scrapes
    return total


def test_every_dashboard_query_returns_data_from_a_live_mount(
        bucket: tuple[Any, str], mount_factory: Any, tmp_path: Path) -> None:
    client, name = bucket
    for i in range(FILES):
        client.put_object(Bucket=name, Key=f"data/f{i:03d}.bin", Body=os.urandom(FILE_SIZE))
    mount = mount_factory(f"s3://{name}/data", "--block-size", "256K")

    proc, base = start_prometheus(tmp_path, mount.metrics_addr)
    try:
        wait_until("prometheus ready", lambda: urllib.request.urlopen(
            f"{base}/-/ready", timeout=2).status == 200)
        wait_until("first scrape", lambda: any(
            t["health"] == "up" for t in api(base, "/api/v1/targets")["activeTargets"]))

        assert read_workload(mount.path) == 2 * FILES * FILE_SIZE
        time.sleep(3)  # two more scrapes after the last read
        at = str(time.time())

        empty: list[str] = []
        values: dict[str, list[float]] = {}
        exprs = [(title, t["expr"]) for title, t in targets(load_dashboard())]
        assert len(exprs) >= 30
        for title, expr in exprs:
            query = grafana_to_promql(expr)
            data = api(base, "/api/v1/query", query=query, time=at)
            assert data["resultType"] in ("vector", "scalar"), (title, data)
            result = data["result"]
            samples = [result] if data["resultType"] == "scalar" else [r["value"] for r in result]
            if not samples:
                empty.append(f"{title}: {query}")
            values[expr] = [float(v) for _, v in samples]
        log = (tmp_path / "prometheus.log").read_text()
        assert not empty, "queries without data:\n" + "\n".join(empty) + "\n" + log[-2000:]
        # The reads above were served by the request workers, fetched by S3 threads and
        # scheduled by the trio thread: each group's CPU shows.
        by_group = {r["metric"]["threads"]: float(r["value"][1]) for r in api(
            base, "/api/v1/query", query="cachefs_thread_cpu_seconds_total", time=at)["result"]}
        assert all(by_group.get(g, 0) > 0 for g in ("event_loop", "fuse", "s3")), by_group
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def value(metric: str, template: str = "sum(rate({}[$__rate_interval]))") -> float:
        expr = template.format(metric + '{instance=~"$instance"}')
        assert expr in values, f"the dashboard no longer queries {expr}"
        return sum(values[expr])

    # The workload shows where the panels say it should.
    for counter in ("cachefs_read_bytes_total", "cachefs_s3_bytes_total",
                    "cachefs_cache_hit_bytes_total", "cachefs_cache_miss_bytes_total"):
        assert value(counter) > 0, counter
    assert value("cachefs_build_info", "count({})") == 1
    hit, miss = value("cachefs_cache_hit_bytes_total"), value("cachefs_cache_miss_bytes_total")
    (ratio,) = [v for e, v in values.items() if e.startswith("sum(rate(cachefs_cache_hit_bytes")
                and "/" in e]
    assert ratio == [pytest.approx(hit / (hit + miss))]
    # A healthy node: the error panels have series, all at zero.
    assert value("cachefs_s3_errors_total") == 0
    assert value("cachefs_s3_errors_total", "sum by (op, kind) (rate({}[$__rate_interval]))") == 0
    assert value("cachefs_s3_throttles_total", "sum by (op) (rate({}[$__rate_interval]))") == 0
