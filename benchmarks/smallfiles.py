"""Small files: files/s, link use and the daemon's cost per file, cold and warm.

    python -m benchmarks.smallfiles                     # cachefs (+ without passthrough), peers, local
    python -m benchmarks.smallfiles --systems cachefs --passes warm   # one focused measurement
    python -m benchmarks.smallfiles --quick             # seconds (tests/test_bench_quick.py runs it)

The dataset is ``--files`` files of ``--min-kb``..``--max-kb`` in ``--folders``
folders (``--nest N``: grouped N to a parent folder, a tree of two levels) on a
SeaweedFS origin behind the WAN emulator (70 ms RTT, 48 MB/s in total, 16 MB/s per
connection by default). ``--threads`` reader threads read
whole files (``open(p, 'rb').read()``), taking turns over one list.

Passes (each system gets a fresh, empty cache for every cold pass):

* ``cold``           -- directory order (sorted paths), cold cache;
* ``warm``           -- the same order again after the page cache (and dentries) were dropped;
* ``warm-shuffled``  -- a fresh random order, page cache dropped;
* ``shuffled``       -- cold cache, a random order, no hint;
* ``shuffled-hint``  -- cold cache, a random order handed to cachefs first (the read-order hint).

Per pass it reports files/s (and the share of local disk's files/s for warm
passes, of the link for cold ones) and, for cachefs, what a file costs the
daemon: CPU (user + system, from ``/proc/<pid>/stat``, all threads; the trio
thread's share from ``/proc/<pid>/task``), FUSE requests by operation, LMDB
transactions, S3 GETs, thread hops and bytes copied, all per file, from the
daemon's metrics. Every pass also reports the machine's busy share and the cores
each process of the rig used (daemon, origin, WAN emulator, readers), so a pass
bound by the rig's own CPU is told apart from one bound by the daemon.
``cachefs-nopt`` is cachefs with ``--passthrough off`` (a node whose kernel or
privileges give no FUSE passthrough): reads of verified cache files are then
answered by the native request loop (``--native-reads``); pass
``--cachefs-arg=--native-reads=off`` too for the all-Python daemon.

Wall-clock numbers need a quiet machine: the origin, the emulator, the daemon
and the readers share the cores. The per-file counts and CPU are meaningful
on a busy one too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.origin import SeaweedOrigin
from benchmarks.systems import Mounted, mount_cachefs, mount_rclone, mount_s3fs
from benchmarks.util import (
    CLK_TCK,
    add_link_args,
    drop_caches,
    fuse_usable,
    per_label,
    proc_sample,
    scrape_labeled,
    stop_cleanly_on_signals,
    thread_samples,
    write_rows,
)
from benchmarks.wan import WanLink

BUCKET = "small"
PREFIX = "ds"
SYSTEMS = ("cachefs", "cachefs-nopt", "rclone", "s3fs", "local")
PASSES = ("cold", "warm", "warm-shuffled", "shuffled", "shuffled-hint")
WARM = ("warm", "warm-shuffled")


# -- dataset -----------------------------------------------------------------------------
def dataset(files: int, folders: int, min_kb: int, max_kb: int, seed: int,
            nest: int = 0) -> list[tuple[str, int]]:
    """``files`` files of ``min_kb``..``max_kb`` KB dealt round the ``folders`` folders;
    with ``nest``, the folders are grouped ``nest`` to a parent folder (a tree of two
    levels: ``p000/c000/``, ..., ``p000/c{nest-1}/``, ``p001/c{nest}/``, ...)."""
    rnd = random.Random(seed)

    def folder(f: int) -> str:
        return f"p{f // nest:03d}/c{f:03d}" if nest else f"c{f:03d}"

    return [(f"{folder(i % folders)}/img{i:06d}.jpg", rnd.randint(min_kb * 1000, max_kb * 1000))
            for i in range(files)]


def payload(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def prepare(origin: SeaweedOrigin, local: Path, items: list[tuple[str, int]],
            checksum: str | None = None) -> None:
    """Upload the dataset, and delete what an earlier run in the same ``--workdir`` left
    under the prefix: a mount lists and reads ahead every object there, so files of
    another shape would be fetched for no reader. With ``checksum`` (``CRC64NVME``) each
    upload carries that full-object checksum, which the origin then states on GETs asked
    for it, as S3 does for every object written since December 2024 (SeaweedFS stores one
    only when the upload sends it); without one, the ETag (an MD5) is all a reader can
    check the bytes against."""
    origin.ensure_bucket(BUCKET)
    s3 = origin.client(max_pool=16)
    wanted = {f"{PREFIX}/{key}" for key, _ in items}
    stale = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"{PREFIX}/") for o in page.get("Contents", [])
        if o["Key"] not in wanted]
    for i in range(0, len(stale), 1000):
        s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in stale[i:i + 1000]]})

    def put(item: tuple[str, int]) -> None:
        key, size = item
        data = payload(key, size)
        extra = {"ChecksumAlgorithm": checksum} if checksum else {}
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=data, **extra)
        path = local / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, items))


# -- measuring -----------------------------------------------------------------------------
def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (threads of one name summed; the main
    thread is "main"), as the scheduler counts them (:class:`ThreadSample` says why not
    the ticks)."""
    out: dict[str, float] = {}
    for t in thread_samples(pid):
        out[t.name] = out.get(t.name, 0.0) + t.cpu_s
    return out


def thread_group(name: str) -> str:
    """The group a thread of the daemon counts in: "trio" (the main thread, which runs
    trio), "s3" (trio's worker threads: S3 requests and cache writes), "verify" (the
    passthrough layer's threads that verify and register files ahead of their opens,
    named for the OS by :func:`cachefs.background.own_threads`; Linux keeps 15 bytes of a
    name), "workers" (the FUSE request workers and other plain Python threads)."""
    if name == "main":
        return "trio"
    if name.startswith(("Trio thread", "cachefs-s3")):
        return "s3"
    if name.startswith("cachefs-verify"):
        return "verify"
    return "workers"


def group_switches(pid: int) -> dict[str, int]:
    """Voluntary context switches of the live threads of a process, by :func:`thread_group`
    (a thread's voluntary switches count its sleeps: each wake-up of the trio thread, each
    wait for a lock or the GIL)."""
    out: dict[str, int] = {}
    for t in thread_samples(pid):
        g = thread_group(t.name)
        out[g] = out.get(g, 0) + t.voluntary
    return out


def context_switches(pid: int) -> int:
    """Context switches (voluntary + involuntary) of every live thread of a process so far:
    each hand-over between threads (a thread hop, a contended GIL) costs two or more."""
    return sum(t.voluntary + t.involuntary for t in thread_samples(pid))


def host_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # (guest time is counted in user already)
    return (total - idle) / CLK_TCK, total / CLK_TCK


#: The rig's other processes, by role (set once the origin and the emulator run): each
#: pass reports the cores each of them used, so a pass bound by the rig's own CPU (the
#: origin, the emulator) is told apart from one bound by the daemon.
RIG_PIDS: dict[str, int] = {}


def rig_cpu(daemon: int | None) -> dict[str, float]:
    """CPU seconds so far of the rig's processes (:data:`RIG_PIDS`), of the daemon under
    test (its pid, if it has one) and of this process (the readers), by role."""
    out = {"readers": sum(os.times()[:2])}
    pids = {**RIG_PIDS, "daemon": daemon} if daemon else RIG_PIDS
    for role, pid in pids.items():
        sample = proc_sample(pid)
        if sample is not None:
            out[role] = sample.cpu_s
    return out


def read_pass(root: Path, order: list[str], threads: int) -> tuple[float, int]:
    def read(rel: str) -> int:
        with open(root / rel, "rb") as f:
            return len(f.read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, order))
    return time.perf_counter() - t0, total


@contextlib.contextmanager
def py_spy(pid: int | None, out: Path | None, gil: bool = False) -> Iterator[None]:
    """Record the daemon with py-spy (if asked and installed) while the block runs; with
    ``gil``, only the thread holding the interpreter lock is sampled (py-spy ``--gil``:
    where the daemon's one interpreter goes, as opposed to where its threads wait)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if pid is None or out is None or not os.path.exists(exe):
        yield
        return
    # --nonblocking: sampling without stopping the daemon (a stopped daemon runs several
    # times slower under the sampling rate; a sample may now and then be torn).
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--threads", "--nonblocking", "--format",
                             "raw", "--rate", "500", "--output", str(out),
                             *(["--gil"] if gil else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def inflight_sampler(url: str | None, every: float, out: dict[str, Any]) -> Iterator[None]:
    """Sample the daemon's S3 fetches in flight every ``every`` seconds while the block runs
    (each scrape costs the daemon some CPU: off unless asked); mean and max into ``out``."""
    if url is None or every <= 0:
        yield
        return
    samples: list[float] = []
    received: list[tuple[float, float]] = []  # (time, S3 bytes so far)
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            with contextlib.suppress(OSError):
                met = scrape_labeled(url)
                samples.append(met.get("cachefs_inflight_fetches", 0.0))
                received.append((time.monotonic(), met.get("cachefs_s3_bytes_total", 0.0)))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        busy = [x for x in samples if x > 0]
        if samples:
            out["gets_in_flight"] = {"mean": round(sum(samples) / len(samples), 1),
                                     "mean_busy": round(sum(busy) / len(busy), 1) if busy else 0.0,
                                     "max": max(samples), "samples": len(samples)}
        # S3 bytes/s over the middle half of the pass: the steady state, without the
        # start (listings, walks proving their order) and the tail (the last GETs).
        if received:  # (seconds into the pass, S3 MB so far, fetches in flight)
            t_start = received[0][0] - every
            out["series"] = [(round(t - t_start, 2), round(b / 1e6, 1), n)
                             for (t, b), n in zip(received, samples, strict=False)]
        if len(received) >= 8:
            (t0, b0), (t1, b1) = received[len(received) // 4], received[3 * len(received) // 4]
            if t1 > t0:
                out["steady_MB_per_s"] = round((b1 - b0) / (t1 - t0) / 1e6, 1)


def measure(m: Mounted, name: str, order: list[str], nbytes: int, threads: int,
            spy: Path | None = None, before_read: Any = None,
            sample_every: float = 0.0, spy_gil: bool = False) -> dict[str, Any]:
    drop_caches()
    met0 = scrape_labeled(m.metrics_url) if m.metrics_url else {}
    cpu0 = proc_sample(m.pid).cpu_s if m.pid else 0.0  # type: ignore[union-attr]
    thr0 = thread_cpu(m.pid) if m.pid else {}
    csw0 = context_switches(m.pid) if m.pid else 0
    gsw0 = group_switches(m.pid) if m.pid else {}
    sampled: dict[str, Any] = {}
    host0 = host_cpu()
    rig0 = rig_cpu(m.pid)
    with py_spy(m.pid, spy, spy_gil), inflight_sampler(m.metrics_url, sample_every, sampled):
        if before_read is not None:
            before_read()
        seconds, total = read_pass(m.root, order, threads)
    host1 = host_cpu()
    rig1 = rig_cpu(m.pid)
    n = len(order)
    assert total == nbytes, f"{m.system} {name}: read {total} bytes, expected {nbytes}"
    row: dict[str, Any] = {"system": m.system, "pass": name, "files": n, "seconds": round(seconds, 3),
                           "files_per_s": round(n / seconds, 1), "MB_per_s": round(total / seconds / 1e6, 2),
                           # the machine's busy share over the pass (every process, all cores):
                           # near 1, the pass was bound by CPU, not by the link
                           "host_cpu_busy": round((host1[0] - host0[0]) / max(1e-9, host1[1] - host0[1]), 2)}
    # cores each process used over the pass (the daemon's per file: cpu_us_per_file)
    wall = max(1e-9, seconds)
    row["cores_by_process"] = {role: round((v - rig0.get(role, 0.0)) / wall, 2)
                               for role, v in rig1.items()}
    if m.pid:
        time.sleep(0.3)  # write-backs still running belong to the pass
        cpu1 = proc_sample(m.pid).cpu_s  # type: ignore[union-attr]
        thr1 = thread_cpu(m.pid)
        # (threads that ended during the pass are not counted: trio's idle workers live 10 s)
        row["context_switches_per_file"] = round((context_switches(m.pid) - csw0) / n, 1)
        row["cpu_us_per_file"] = round((cpu1 - cpu0) / n * 1e6, 1)
        row["thread_cpu_us_per_file"] = {k: round((v - thr0.get(k, 0.0)) / n * 1e6, 1)
                                         for k, v in thr1.items() if v - thr0.get(k, 0.0) > 0}
        groups: dict[str, float] = {}
        for k, v in row["thread_cpu_us_per_file"].items():
            g = thread_group(k)
            groups[g] = round(groups.get(g, 0.0) + v, 1)
        row["cpu_us_per_file_by_group"] = groups
        row["voluntary_switches_per_file_by_group"] = {
            g: round((v - gsw0.get(g, 0)) / n, 2) for g, v in group_switches(m.pid).items()}
    if m.metrics_url:
        met1 = scrape_labeled(m.metrics_url)
        row["fuse_per_file"] = per_label(met0, met1, "cachefs_fuse_requests_total", n)
        row["fuse_native_per_file"] = per_label(met0, met1, "cachefs_fuse_native_answers_total", n)
        row["lmdb_txn_per_file"] = per_label(met0, met1, "cachefs_lmdb_transactions_total", n)
        row["thread_hops_per_file"] = per_label(met0, met1, "cachefs_thread_hops_total", n)
        row["fuse_handed_over_per_file"] = per_label(met0, met1, "cachefs_fuse_handed_over_total",
                                                     n)
        prepared = per_label(met0, met1, "cachefs_passthrough_prepared_total", n)
        if prepared:  # files verified ahead of their open, by outcome
            row["passthrough_prepared_per_file"] = prepared
        # mean time from a request's read off the device to its answer, per operation
        counts = per_label(met0, met1, "cachefs_fuse_request_duration_seconds_count", 1)
        sums = per_label(met0, met1, "cachefs_fuse_request_duration_seconds_sum", 1)
        row["fuse_mean_us"] = {op: round(sums.get(op, 0.0) / c * 1e6, 1)
                               for op, c in counts.items() if c}
        gets = met1.get("cachefs_s3_requests_total{op=get}", 0) - met0.get("cachefs_s3_requests_total{op=get}", 0)
        row["s3_gets_per_file"] = round(gets / n, 3)
        # the check each received byte passed (etag_md5 costs ~50x a CRC: --origin-checksum)
        checked = per_label(met0, met1, "cachefs_s3_verified_bytes_total", n)
        if checked:
            row["s3_checked_bytes_per_file"] = checked
        # One GET's time on the wire (connection, request, answer): with the GETs in flight
        # sampled, Little's law tells what files/s the link could have given.
        key = "cachefs_s3_request_duration_seconds_{}{{op=get}}"
        get_n = met1.get(key.format("count"), 0) - met0.get(key.format("count"), 0)
        if get_n:
            get_s = met1.get(key.format("sum"), 0) - met0.get(key.format("sum"), 0)
            row["s3_get_mean_ms"] = round(get_s / get_n * 1e3, 1)
        s3b = met1.get("cachefs_s3_bytes_total", 0) - met0.get("cachefs_s3_bytes_total", 0)
        row["s3_bytes_per_byte_read"] = round(s3b / nbytes, 3)
        read = met1.get("cachefs_read_bytes_total", 0) - met0.get("cachefs_read_bytes_total", 0)
        row["daemon_read_bytes_per_file"] = round(read / n)
        issued = per_label(met0, met1, "cachefs_prefetch_issued_bytes_total", n)
        used = per_label(met0, met1, "cachefs_prefetch_used_bytes_total", n)
        if issued:  # bytes per file fetched ahead, by policy, and the share of them read
            row["prefetch_bytes_per_file"] = {p: round(v) for p, v in issued.items()}
            row["prefetch_used_share"] = {p: round(used.get(p, 0.0) / v, 3)
                                          for p, v in issued.items()}
        advised = per_label(met0, met1, "cachefs_disk_readahead_total", n)
        if advised:  # cache files read into the page cache ahead, by outcome
            row["disk_readahead_per_file"] = advised
        tiers = per_label(met0, met1, "cachefs_tier_read_bytes_total", n)
        if tiers:  # bytes per file the daemon served, by where they came from
            row["read_bytes_per_file_by_tier"] = {t: round(v) for t, v in tiers.items()}
        swept = met1.get("cachefs_sweep_files_total", 0) - met0.get("cachefs_sweep_files_total", 0)
        if swept:
            row["swept_files_per_file"] = round(swept / n, 3)
    row.update(sampled)
    return row


# -- systems ---------------------------------------------------------------------------------
def mount_system(system: str, endpoint: str, run_dir: Path, local: Path,
                 extra: list[str]) -> contextlib.AbstractContextManager[Mounted]:
    if system == "local":
        return contextlib.nullcontext(Mounted("local", local, None))
    if system in ("cachefs", "cachefs-nopt"):
        args = ["--metadata-ttl", "1h", *extra]
        if system == "cachefs-nopt":
            args += ["--passthrough", "off"]
        return _renamed(mount_cachefs(endpoint, BUCKET, PREFIX, run_dir, extra=args), system)
    fn = {"rclone": mount_rclone, "s3fs": mount_s3fs}[system]
    return fn(endpoint, BUCKET, PREFIX, run_dir)


@contextlib.contextmanager
def _renamed(cm: contextlib.AbstractContextManager[Mounted], system: str) -> Iterator[Mounted]:
    with cm as m:
        m.system = system
        yield m


def run_system(system: str, passes: list[str], endpoint: str, work: Path, local: Path,
               items: list[tuple[str, int]], threads: int, seed: int, extra: list[str],
               spy_dir: Path | None, sample_every: float = 0.0,
               spy_gil: bool = False) -> list[dict[str, Any]]:
    keys = [k for k, _ in items]
    nbytes = sum(s for _, s in items)
    in_order = sorted(keys)
    rows: list[dict[str, Any]] = []
    run_dir = work / f"run-{system}"

    def shuffled(salt: int) -> list[str]:
        order = in_order[:]
        random.Random(seed * 100 + salt).shuffle(order)
        return order

    def spy(name: str) -> Path | None:
        return spy_dir / f"{system}-{name}.folded" if spy_dir else None

    def go(m: Mounted, name: str, order: list[str], hint: bool = False) -> None:
        def send() -> None:
            from cachefs.control.client import send_hint
            send_hint(str(m.root / k) for k in order)

        row = measure(m, name, order, nbytes, threads, spy(name), send if hint else None,
                      sample_every, spy_gil)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # cold (directory order), then the warm passes over the same cache
    if any(p in ("cold", *WARM) for p in passes):
        with mount_system(system, endpoint, run_dir, local, extra) as m:
            if system != "local":
                if "cold" in passes:
                    go(m, "cold", in_order)
                else:
                    read_pass(m.root, in_order, threads)  # fill the cache, unmeasured
            for i, name in enumerate(p for p in passes if p in WARM):
                go(m, name, in_order if name == "warm" else shuffled(i + 1))
    for name in ("shuffled", "shuffled-hint"):
        if name not in passes or system == "local":
            continue
        if name == "shuffled-hint" and not system.startswith("cachefs"):
            continue
        with mount_system(system, endpoint, run_dir, local, extra) as m:
            go(m, name, shuffled(10), hint=name == "shuffled-hint")
    return rows


def summary(rows: list[dict[str, Any]], link_MBps: float) -> str:
    local = {r["pass"]: r["files_per_s"] for r in rows if r["system"] == "local"}
    lines = ["| system | pass | files/s | share | daemon CPU us/file (trio thread) | FUSE requests/file | "
             "LMDB txns/file | thread hops/file | GETs/file | host busy; cores by process |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["pass"] in WARM:
            share = f"{r['files_per_s'] / local[r['pass']]:.2f} of local" if local.get(r["pass"]) else "-"
        else:
            share = f"{r['MB_per_s'] / link_MBps:.2f} of link"
        cpu = "-"
        if "cpu_us_per_file" in r:
            th = r.get("thread_cpu_us_per_file", {})
            main = th.get("main", 0.0)
            cpu = f"{r['cpu_us_per_file']:.0f} ({main:.0f})"
        fuse = " ".join(f"{k} {v:g}" for k, v in sorted(r.get("fuse_per_file", {}).items()))
        lmdb = " ".join(f"{k} {v:g}" for k, v in sorted(r.get("lmdb_txn_per_file", {}).items()))
        hops = " ".join(f"{k} {v:g}" for k, v in sorted(r.get("thread_hops_per_file", {}).items()))
        cores = " ".join(f"{k} {v:g}" for k, v in r.get("cores_by_process", {}).items() if v)
        lines.append(f"| {r['system']} | {r['pass']} | {r['files_per_s']:.0f} | {share} | {cpu} | "
                     f"{fuse or '-'} | {lmdb or '-'} | {hops or '-'} | {r.get('s3_gets_per_file', '-')} | "
                     f"{r.get('host_cpu_busy', '-')}; {cores or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    stop_cleanly_on_signals()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.smallfiles",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--files", type=int, default=1200)
    ap.add_argument("--folders", type=int, default=20)
    ap.add_argument("--min-kb", type=int, default=80)
    ap.add_argument("--max-kb", type=int, default=140)
    ap.add_argument("--nest", type=int, default=0, metavar="N",
                    help="group the folders N to a parent folder (a two-level tree; 0: one level)")
    ap.add_argument("--threads", type=int, default=4)
    add_link_args(ap)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--origin-checksum", choices=("none", "CRC64NVME"), default="none",
                    help="the full-object checksum uploads carry and the origin states "
                         "(S3 states CRC64NVME for every new object; the issue's table: none)")
    ap.add_argument("--cachefs-arg", action="append", default=[],
                    help="extra argument for cachefs mount (repeatable)")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="record the daemon with py-spy during every pass (folded stacks in DIR)")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="with --py-spy: sample only the thread holding the interpreter lock")
    ap.add_argument("--sample-inflight", type=float, default=0.0, metavar="SECONDS",
                    help="sample cachefs's S3 GETs in flight this often during each pass "
                         "(scrapes cost the daemon CPU; off by default)")
    ap.add_argument("--quick", action="store_true", help="120 files, 2 folders, RTT 20 ms")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.files, args.folders, args.rtt_ms = 120, 4, 20.0
    ok, why = fuse_usable()
    if not ok:
        print(f"FUSE is not usable here: {why}", file=sys.stderr)
        return 1
    systems = [s for s in args.systems.split(",") if s]
    passes = [p for p in args.passes.split(",") if p]
    bad = [s for s in systems if s not in SYSTEMS] + [p for p in passes if p not in PASSES]
    if bad:
        print(f"unknown system or pass: {', '.join(bad)}", file=sys.stderr)
        return 2
    if any(p in WARM for p in passes) and "local" not in systems:
        systems.append("local")  # the reference of the warm passes
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cachefs-small-"))
    work.mkdir(parents=True, exist_ok=True)
    items = dataset(args.files, args.folders, args.min_kb, args.max_kb, args.seed, args.nest)
    local = work / "local"
    rows: list[dict[str, Any]] = []
    try:
        with SeaweedOrigin(work / "s3") as origin:
            prepare(origin, local, items,
                    None if args.origin_checksum == "none" else args.origin_checksum)
            with WanLink(origin.s3_port, args.rtt_ms, args.bandwidth_MBps, args.conn_bandwidth_MBps,
                         log_path=str(work / "wan.log")) as wan:
                if origin.proc is not None:
                    RIG_PIDS["origin"] = origin.proc.pid
                if wan.proc is not None:
                    RIG_PIDS["emulator"] = wan.proc.pid
                for system in systems:
                    rows += run_system(system, passes, wan.endpoint, work, local, items, args.threads,
                                       args.seed, args.cachefs_arg, args.py_spy, args.sample_inflight,
                                       args.py_spy_gil)
        print(summary(rows, args.bandwidth_MBps))
        if args.json:
            write_rows(args.json, args, rows)
    finally:  # (also when interrupted: SIGTERM ends it like Ctrl-C)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
