"""``cachefs plan`` formulas and ``cachefs probe`` against a real S3 server."""

from __future__ import annotations

import json
import math

import pytest

from cachefs.cli.plan import Inputs, hit_ratio, plan
from tests.conftest import run_cachefs


def test_hit_ratio_formulas():
    assert hit_ratio("keep", 0.5) == 0.5
    assert hit_ratio("lru", 0.5) == pytest.approx(0.5 + 0.5 * math.log(0.5))  # ~0.153
    assert hit_ratio("lru", 0.8) == pytest.approx(0.478, abs=1e-3)
    assert hit_ratio("keep", 1.2) == hit_ratio("lru", 1.0) == 1.0


def test_plan_parity_and_bounds():
    base = dict(dataset_bytes=100 * 10**9, bandwidth=150e6, latency=0.07, demand=300e6,
                files=1_000_000, in_flight=200, workers=8, epochs=5)
    fits = plan(Inputs(cache_bytes=200 * 10**9, **base))
    assert fits["policies"]["keep"]["parity"] and fits["policies"]["lru"]["parity"]
    assert fits["warmup_lower_bound_seconds"] == pytest.approx(100e9 / 150e6)
    # 100 KB files round up to 4 KiB: 2 KiB more each on average, so the cache's half of the
    # dataset is half of its footprint, 51.0 GB.
    assert fits["footprint_bytes"] == 10**6 * (100_000 + 2048)
    half = plan(Inputs(cache_bytes=10**6 * (100_000 + 2048) // 2, **base))
    keep, lru = half["policies"]["keep"], half["policies"]["lru"]
    assert keep["hit_ratio"] == 0.5 and keep["remote_bytes_per_epoch"] == pytest.approx(50e9)
    assert keep["steady_bytes_per_s"] == pytest.approx(300e6)  # 150 MB/s / (1 - 0.5) = R
    assert keep["parity"] and not lru["parity"]
    assert half["parity_cache_fraction_needed"] == pytest.approx(0.5)
    assert half["latency_bound_workers_bytes_per_s"] == pytest.approx(8 * 1e5 / 0.07)


def test_plan_cli_prints_formulas_and_json():
    proc = run_cachefs("plan", "--dataset-size", "144G", "--cache-size", "72G", "--bandwidth",
                       "150MB/s", "--latency", "70ms", "--demand", "1.8GB/s", "--files",
                       "1281167")
    assert proc.returncode == 0, proc.stderr
    assert "h = c + (1-c) ln(1-c)" in proc.stdout and "c >= 1 - B/R" in proc.stdout
    proc = run_cachefs("plan", "--dataset-size", "1G", "--cache-size", "2G", "--bandwidth",
                       "10Gbit", "--latency", "70ms", "--demand", "500MB/s", "--json")
    data = json.loads(proc.stdout)
    assert data["inputs"]["bandwidth"] == pytest.approx(1.25e9)
    assert data["policies"]["keep"]["parity"] is True


def test_plan_bad_input_is_one_line():
    proc = run_cachefs("plan", "--dataset-size", "lots", "--cache-size", "1G", "--bandwidth",
                       "1MB/s", "--latency", "1ms", "--demand", "1MB/s")
    assert proc.returncode == 2 and proc.stderr.startswith("cachefs: error: invalid size")
    proc = run_cachefs("plan", "--dataset-size", "1G", "--cache-size", "1G", "--demand", "1MB/s")
    assert proc.returncode == 2 and "--probe" in proc.stderr and "Traceback" not in proc.stderr


def test_probe_measures_a_real_bucket_and_feeds_plan(bucket, s3_endpoint, tmp_path):
    client, name = bucket
    for i in range(4):
        client.put_object(Bucket=name, Key=f"p/d{i}/obj", Body=b"z" * (1 << 20))
    proc = run_cachefs("probe", f"s3://{name}/p", "--endpoint-url", s3_endpoint, "--samples",
                       "3", "--parallel", "2", "--seconds", "0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["objects_seen"] == 4
    assert result["single_stream_bytes_per_s"] > 0 and result["parallel_bytes_per_s"] > 0
    assert 0 < result["get_latency_p50_s"] <= result["get_latency_p90_s"]
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(proc.stdout)
    planned = run_cachefs("plan", "--probe", str(probe_file), "--dataset-size", "10G",
                          "--cache-size", "5G", "--demand", "1GB/s", "--json")
    assert planned.returncode == 0, planned.stderr
    inputs = json.loads(planned.stdout)["inputs"]
    assert inputs["bandwidth"] == pytest.approx(result["parallel_bytes_per_s"])


def test_probe_of_missing_bucket_is_one_line(s3_endpoint):
    proc = run_cachefs("probe", "s3://no-such-bucket-xyz", "--endpoint-url", s3_endpoint,
                       "--seconds", "0.2")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


def test_cluster_cross_region_bytes_with_and_without_a_shared_tier():
    from cachefs.cli.plan import cluster

    base = dict(dataset_bytes=100 * 10**9, bandwidth=100e6, latency=0.07, demand=1e9,
                files=10**6, in_flight=96, workers=8, epochs=3, nodes=4)
    r = cluster(Inputs(cache_bytes=10**12, **base))
    without = [e["cross_region_bytes_without"] / 1e11 for e in r["epochs"]]
    assert without == pytest.approx([1.0, 0.75, 0.5625])  # 2.31 S at N = 4 over 3 epochs
    assert r["cross_region_bytes_with"] == pytest.approx(1e11)
    assert r["warmup_bytes_without"] == 4e11 and r["warmup_bytes_with"] == 1e11
    assert r["epochs"][1]["seconds_with"] == pytest.approx(1e11 / 4e9)  # compute-bound
    # Node caches of 30% (of the footprint: 100 KB files take 2 KiB more each) cap what each
    # keeps; a shared tier of half the dataset misses half.
    capped = cluster(Inputs(cache_bytes=3 * 10**5 * (100_000 + 2048), shared_bytes=5 * 10**10,
                            **base))
    assert capped["epochs"][2]["cross_region_bytes_without"] == pytest.approx(0.7e11)
    assert capped["epochs"][2]["cross_region_bytes_with"] == pytest.approx(0.5e11)


def test_plan_cli_nodes_prints_the_cluster_table():
    proc = run_cachefs("plan", "--dataset-size", "100G", "--cache-size", "2T", "--bandwidth",
                       "150MB/s", "--latency", "70ms", "--demand", "1GB/s", "--epochs", "3",
                       "--nodes", "4")
    assert proc.returncode == 0, proc.stderr
    assert "cluster of N = 4 nodes" in proc.stdout and "(2.31 S)" in proc.stdout
    assert "'cachefs warm --shard I/N'" in proc.stdout
    proc = run_cachefs("plan", "--dataset-size", "1G", "--cache-size", "1G", "--bandwidth",
                       "1GB/s", "--latency", "1ms", "--demand", "1GB/s", "--nodes", "2",
                       "--json")
    assert json.loads(proc.stdout)["cluster"]["warmup_bytes_without"] == 2 * 2**30
    proc = run_cachefs("plan", "--dataset-size", "1G", "--cache-size", "1G", "--bandwidth",
                       "1GB/s", "--latency", "1ms", "--demand", "1GB/s", "--nodes", "0")
    assert proc.returncode == 2 and "--nodes" in proc.stderr


# -- the cache footprint: what the dataset takes under --cache-size ---------------------------
TINY = dict(dataset_bytes=2 * 10**9, files=10**6, bandwidth=150e6, latency=0.07, demand=300e6,
            in_flight=200, workers=8, epochs=3)  # 1 M files of 2 KB


def test_tiny_files_whose_bytes_fit_do_not_fit_by_their_footprint():
    # 2 GB of data in a 3 GB cache, but every file takes a whole 4 KiB unit of the cache's
    # disk space (the unit --cache-size counts): 4.1 GB, so not all of it stays cached.
    r = plan(Inputs(cache_bytes=3 * 10**9, **TINY))
    keep, lru = r["policies"]["keep"], r["policies"]["lru"]
    assert keep["hit_ratio"] == pytest.approx(3e9 / 4.096e9) and keep["hit_ratio"] < 0.74
    assert lru["hit_ratio"] == pytest.approx(hit_ratio("lru", 3e9 / 4.096e9))
    assert r["cache_fraction"] == pytest.approx(0.732, abs=1e-3)
    assert keep["remote_bytes_per_epoch"] == pytest.approx(2e9 * (1 - 3e9 / 4.096e9))
    # The misses of 2 KB files are latency bound (200 x 2 KB / 70 ms = 5.7 MB/s): no parity.
    bound = r["latency_bound_prefetch_bytes_per_s"]
    assert keep["steady_bytes_per_s"] == pytest.approx(bound / (1 - 3e9 / 4.096e9))
    assert not keep["parity"]
    assert r["footprint_bytes"] == 10**6 * 4096
    # A cache the size of the footprint holds it all again.
    assert plan(Inputs(cache_bytes=4096 * 10**6, **TINY))["policies"]["lru"]["hit_ratio"] == 1.0


def test_large_files_keep_their_plan():
    # 100 MB files: rounding to 4 KiB adds 2 KiB a file, 0.002 %: c stays cache / S.
    big = dict(TINY, dataset_bytes=100 * 10**9, files=1000)
    r = plan(Inputs(cache_bytes=50 * 10**9, **big))
    assert r["footprint_bytes"] == pytest.approx(100e9, rel=1e-4)
    assert r["policies"]["keep"]["hit_ratio"] == pytest.approx(0.5, rel=1e-4)
    assert r["policies"]["keep"]["remote_bytes_per_epoch"] == pytest.approx(50e9, rel=1e-4)
    assert plan(Inputs(cache_bytes=100 * 10**9, **big))["policies"]["keep"]["hit_ratio"] < 1.0
    assert plan(Inputs(cache_bytes=101 * 10**9, **big))["policies"]["keep"]["hit_ratio"] == 1.0


def test_footprint_estimate_from_the_mean_file_size():
    from cachefs.cli.plan import footprint

    # Files under half a unit take one unit each; above that, a spread of sizes wastes half a
    # unit a file on average (its last unit's fill is as likely any value).
    assert footprint(2 * 10**9, 10**6, 4096) == 4096 * 10**6
    assert footprint(5000 * 10**6, 10**6, 4096) == (5000 + 2048) * 10**6
    assert footprint(3000 * 10**6, 10**6, 4096) == (3000 + 2048) * 10**6
    assert footprint(2 * 10**9, 10**6, 64 << 10) == (64 << 10) * 10**6
    assert footprint(100 * 10**9, 1000, 4096) == 100 * 10**9 + 2048 * 1000


def test_cluster_node_caches_hold_the_footprint_not_the_bytes():
    from cachefs.cli.plan import cluster

    # Node caches of 3 GB cannot keep 1 M tiny files (4.1 GB on disk): from epoch 2 on, each
    # node still pulls what its cache could not hold. The shared tier stores blocks as objects
    # of their exact length: 2 GB of tier holds the 2 GB of data.
    r = cluster(Inputs(cache_bytes=3 * 10**9, shared_bytes=2 * 10**9, **dict(TINY, nodes=1)))
    later = r["epochs"][2]["cross_region_bytes_without"]
    assert later == pytest.approx(2e9 * (1 - 3e9 / 4.096e9))
    assert r["shared_fraction"] == 1.0 and r["epochs"][2]["cross_region_bytes_with"] == 0


def test_plan_cli_prints_the_footprint_of_tiny_files():
    args = ("plan", "--dataset-size", "2G", "--cache-size", "3G", "--bandwidth", "150MB/s",
            "--latency", "70ms", "--demand", "300MB/s", "--mean-file-size", "2K")
    proc = run_cachefs(*args)
    assert proc.returncode == 0, proc.stderr
    assert "cache footprint F = 4.3 GB for S = 2.1 GB" in proc.stdout, proc.stdout
    data = json.loads(run_cachefs(*args, "--json").stdout)
    assert data["footprint_bytes"] == (2 << 30) // 2048 * 4096
    assert data["inputs"]["allocation_unit"] == 4096
    assert data["policies"]["keep"]["hit_ratio"] == pytest.approx(3 / 4)
    # A file system allocating 64 KiB units (--allocation-unit) makes it 32 times the data.
    data = json.loads(run_cachefs(*args, "--json", "--allocation-unit", "64K").stdout)
    assert data["footprint_bytes"] == (2 << 30) // 2048 * (64 << 10)
    # Large files: no footprint line, the plan reads as before.
    proc = run_cachefs("plan", "--dataset-size", "100G", "--cache-size", "50G", "--bandwidth",
                       "150MB/s", "--latency", "70ms", "--demand", "300MB/s", "--files", "1000")
    assert proc.returncode == 0 and "footprint" not in proc.stdout
    assert "cache = 53.7 GB -> c = 0.500" in proc.stdout
    proc = run_cachefs(*args, "--allocation-unit", "3K")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--allocation-unit" in proc.stderr and "Traceback" not in proc.stderr


PLAN_BASE = ("plan", "--dataset-size", "1T", "--cache-size", "100G", "--demand", "1GB/s")
LINK = ("--bandwidth", "150MB/s", "--latency", "70ms")


@pytest.mark.parametrize("probe_text", [
    "{}",  # not what 'cachefs probe --json' writes: no figures
    "[1, 2]",  # not an object
    '{"parallel_bytes_per_s": "fast", "get_latency_p50_s": 0.07}',  # not a number
    '{"parallel_bytes_per_s": NaN, "get_latency_p50_s": NaN}',  # probe --seconds nan wrote it
    '{"parallel_bytes_per_s": 1e8, "get_latency_p50_s": -1}',
])
def test_plan_with_a_broken_probe_file_is_one_line(tmp_path, probe_text):
    """A probe file that is JSON but not a probe's figures: before, a KeyError or TypeError
    traceback (or, for NaN, a plan of 'nan PB/s' and exit 0)."""
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(probe_text)
    proc = run_cachefs(*PLAN_BASE, "--probe", str(probe_file))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("cachefs: error:") and proc.stderr.count("\n") == 1, proc.stderr
    assert str(probe_file) in proc.stderr


@pytest.mark.parametrize("extra", [
    ("--mean-file-size", "0"),  # before: ZeroDivisionError traceback
    ("--bandwidth", "nan"), ("--bandwidth", "inf"), ("--demand", "nan"), ("--demand", "inf"),
    ("--latency", "inf"), ("--workers", "0"), ("--workers", "-3"), ("--in-flight", "0"),
    ("--files", "-5"),
])
def test_plan_with_a_figure_it_cannot_use_is_one_line(extra):
    """Each of these planned nonsense with exit 0 ('nan PB/s', 'grow the cache to >= 0%')
    or ended in a traceback."""
    flags = dict(zip(LINK[::2], LINK[1::2], strict=True))
    flags.update({extra[0]: extra[1]})
    args = [a for kv in flags.items() for a in kv]
    proc = run_cachefs(*PLAN_BASE, *args)
    assert proc.returncode == 2, (extra, proc.stdout, proc.stderr)
    assert proc.stderr.startswith("cachefs: error:") and proc.stderr.count("\n") == 1, proc.stderr
    assert extra[0] in proc.stderr, proc.stderr


@pytest.mark.parametrize("seconds", ["nan", "inf"])
def test_probe_for_a_time_that_is_not_a_number_is_one_line(bucket, s3_endpoint, seconds):
    """'--seconds nan' measured nothing and exited 0 (0.0 MB/s, and NaN in --json, which
    plan cannot use); '--seconds inf' (or 1e400) never ended."""
    client, name = bucket
    client.put_object(Bucket=name, Key="p/obj", Body=b"z" * 1024)
    proc = run_cachefs("probe", f"s3://{name}/p", "--endpoint-url", s3_endpoint,
                       "--seconds", seconds, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("cachefs: error:") and "--seconds" in proc.stderr


@pytest.mark.parametrize("flag, value", [("--parallel", "100000"), ("--samples", "100000000"),
                                         ("--seconds", "1e9")])
def test_probe_asked_for_more_than_it_can_do_is_one_line(bucket, s3_endpoint, flag, value):
    """'--parallel 100000' started a thread per stream: the threads' tracebacks (no more
    connections, no more threads) filled the terminal and the probe never ended;
    '--samples 100000000' or '--seconds 1e9' ran for days. Each is bounded now, in one
    line, before any request."""
    client, name = bucket
    client.put_object(Bucket=name, Key="p/obj", Body=b"z" * 1024)
    proc = run_cachefs("probe", f"s3://{name}/p", "--endpoint-url", s3_endpoint, flag, value,
                       timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("cachefs: error:") and proc.stderr.count("\n") == 1, \
        proc.stderr
    assert flag in proc.stderr and "Traceback" not in proc.stderr
