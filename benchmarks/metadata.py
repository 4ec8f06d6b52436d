"""Metadata at dataset scale: walking a million objects through the mount.

    python -m benchmarks.metadata            # 1,000 dirs x 1,000 files + a flat 200,000
    python -m benchmarks.metadata --quick    # 200 dirs x 1,000 files + the flat 200,000

The bucket comes from the synthetic S3 endpoint (:mod:`benchmarks.synthetic_s3`,
run as its own process so its CPU is accounted apart), every request delayed
by ``--delay`` (70 ms: a remote region). For each system (cachefs, rclone
mount) in one run:

* first walk: ``os.scandir`` recursively through a fresh mount (cold cache),
  its wall time and LIST requests;
* daemon CPU per listed entry during that walk (utime+stime from /proc);
* daemon RSS after the walk (anonymous and file-backed: LMDB's map counts as
  file pages);
* index bytes on disk per object (allocated blocks of the LMDB environment);
* walk after a remount over the same cache directory, and its LIST count;
* ``stat`` rate over the walked files right after the walk (and the requests
  it caused);
* the flat prefix: time until ``os.scandir`` yields its first entry, until
  ``ls`` prints its first line and until ``ls`` ends.

Prints Markdown tables and writes the numbers as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.synthetic_s3 import stats
from benchmarks.systems import Mounted, available, mount_cachefs, mount_rclone
from benchmarks.util import drop_caches, fuse_usable, proc_sample, terminate

HERE = Path(__file__).resolve().parent


# -- the synthetic endpoint as a process ---------------------------------------------
@contextlib.contextmanager
def synthetic_server(delay: float) -> Iterator[tuple[str, int]]:
    """Yield (endpoint URL, pid) of a synthetic S3 server process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.synthetic_s3", "--port", "0",
                             "--delay", str(delay)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("ready "):
            raise RuntimeError(f"synthetic S3 server did not start: {line!r}")
        yield line.split()[1], proc.pid
    finally:
        terminate(proc, timeout=5)


# -- measurements -----------------------------------------------------------------------
def memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    s = proc_sample(pid)
    return s.cpu_s if s else 0.0


def walk(root: Path, files: list[str] | None = None) -> tuple[int, int]:
    """Walk ``root`` with os.scandir (directories after their parent's whole listing, in
    readdir order); returns (directories, files). Appends file paths to ``files``."""
    n_dirs = n_files = 0
    stack = [str(root)]
    while stack:
        d = stack.pop()
        subdirs = []
        with os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.path)
                else:
                    n_files += 1
                    if files is not None:
                        files.append(entry.path)
        n_dirs += len(subdirs)
        stack.extend(reversed(subdirs))
    return n_dirs, n_files


def lists(counts: dict[str, int]) -> int:
    return counts.get("list_v2", 0) + counts.get("list_v1", 0)


def disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def stat_rate(paths: list[str], seconds: float) -> tuple[float, int]:
    """stat() the paths in order for at most ``seconds``; returns (stats per second, count)."""
    t0 = time.monotonic()
    n = 0
    deadline = t0 + seconds
    for p in paths:
        os.stat(p)
        n += 1
        if n % 256 == 0 and time.monotonic() > deadline:
            break
    return n / max(time.monotonic() - t0, 1e-9), n


def first_entries(root: Path) -> dict[str, float]:
    """Time to the first os.scandir entry, to ``ls``'s first line and to its end."""
    t0 = time.monotonic()
    with os.scandir(root) as it:
        next(it, None)
        first_scandir = time.monotonic() - t0
    return {"first_scandir_s": first_scandir}


def ls_timing(root: Path) -> dict[str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(["ls", "-1", "--color=never", str(root)], stdout=subprocess.PIPE,
                            env={**os.environ, "LC_ALL": "C"})
    assert proc.stdout is not None
    proc.stdout.readline()
    first = time.monotonic() - t0
    lines = 1 + sum(1 for _ in proc.stdout)
    proc.wait()
    return {"ls_first_line_s": first, "ls_total_s": time.monotonic() - t0, "ls_lines": lines}


# -- one system ------------------------------------------------------------------------------
def _mount(system: str, url: str, bucket: str, run_dir: Path, extra: list[str],
           keep_cache: Path | None = None) -> Any:
    run_dir.mkdir(parents=True, exist_ok=True)
    fn = mount_cachefs if system == "cachefs" else mount_rclone
    return fn(url, bucket, "", run_dir, cache_size="64G", extra=extra, keep_cache=keep_cache)


def warm_run(pid: int, args: list[str]) -> dict[str, Any]:
    """``cachefs warm ARGS`` against the mount of daemon ``pid``: its time, output and the
    daemon's RSS before, at its peak during the run (sampled) and after."""
    import threading

    before = memory(pid)["VmRSS"]
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], memory(pid)["VmRSS"])

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cachefs", "warm", *args], capture_output=True,
                          text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    took = time.monotonic() - t0
    stop.set()
    t.join()
    return {"args": args[1:][:3], "seconds": took, "rc": proc.returncode,
            "output": (proc.stdout.strip().splitlines() or [""])[-1],
            "rss_before": before, "rss_peak": peak[0], "rss_after": memory(pid)["VmRSS"]}


def run_tree(system: str, url: str, bucket: str, run_dir: Path, extra: list[str],
             stat_seconds: float, warm_dirs: int = 0) -> dict[str, Any]:
    res: dict[str, Any] = {"system": system, "bucket": bucket}
    cache = run_dir / "cache-kept"
    files: list[str] = []
    with _mount(system, url, bucket, run_dir, extra, keep_cache=cache) as m:
        m: Mounted
        assert m.pid is not None
        time.sleep(1)
        res["memory_mounted"] = memory(m.pid)
        stats(url, reset=True)
        c0 = cpu(m.pid)
        t0 = time.monotonic()
        n_dirs, n_files = walk(m.root, files)
        res["first_walk_s"] = time.monotonic() - t0
        res["daemon_cpu_s"] = cpu(m.pid) - c0
        res["dirs"], res["files"] = n_dirs, n_files
        res["entries"] = n_dirs + n_files
        res["first_walk_lists"] = lists(stats(url, reset=True))
        res["cpu_us_per_entry"] = 1e6 * res["daemon_cpu_s"] / max(1, res["entries"])
        res["memory_after_walk"] = memory(m.pid)
        rate, n = stat_rate(files, stat_seconds)
        after = stats(url, reset=True)
        res["stat_rate"] = rate
        res["stat_count"] = n
        res["stat_requests"] = sum(after.values())
        res["memory_after_stat"] = memory(m.pid)
        # The kernel forgets its inodes and dentries: what the daemon still holds per
        # object is what it keeps for itself.
        if drop_caches():
            time.sleep(2)
            res["memory_after_forget"] = memory(m.pid)
    del files
    if system == "cachefs":
        res["index_bytes"] = disk_bytes(cache / "meta.lmdb")
        res["index_bytes_per_object"] = res["index_bytes"] / max(1, res["entries"])
    with _mount(system, url, bucket, run_dir, extra, keep_cache=cache) as m:
        stats(url, reset=True)
        t0 = time.monotonic()
        walk(m.root)
        res["remount_walk_s"] = time.monotonic() - t0
        res["remount_walk_lists"] = lists(stats(url, reset=True))
        if system == "cachefs" and warm_dirs:
            assert m.pid is not None
            res["warm_check"] = warm_run(m.pid, [str(m.root), "--check"])
            res["warm"] = warm_run(m.pid, [str(m.root), *sorted(os.listdir(m.root))[:warm_dirs]])
    import shutil
    shutil.rmtree(cache, ignore_errors=True)
    return res


def run_flat(system: str, url: str, bucket: str, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    """``ls`` on a fresh mount, then the first scandir entry on another fresh mount."""
    res: dict[str, Any] = {"system": system, "bucket": bucket}
    with _mount(system, url, bucket, run_dir, extra) as m:
        stats(url, reset=True)
        c0 = cpu(m.pid)
        res.update(ls_timing(m.root / "flat"))
        res["daemon_cpu_s"] = cpu(m.pid) - c0
        res["lists"] = lists(stats(url, reset=True))
        assert m.pid is not None
        res["memory_after"] = memory(m.pid)
    with _mount(system, url, bucket, run_dir, extra) as m:
        res.update(first_entries(m.root / "flat"))
    return res


# -- report ------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def _n(n: int) -> str:
    return f"{n:,}"


def tree_table(rows: list[dict[str, Any]]) -> str:
    out = ["| system | objects (dirs x files) | first walk (LISTs) | daemon CPU per entry | "
           "daemon RSS after (anon + file) | RSS mounted / after the kernel forgot | index on disk | "
           "walk after remount (LISTs) | stat after the walk (requests) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r["memory_after_walk"]
        forgot = r.get("memory_after_forget", {}).get("VmRSS")
        base = f"{_mb(r['memory_mounted']['VmRSS'])} / {_mb(forgot) if forgot else '-'}"
        index = (f"{_mb(r['index_bytes'])} ({r['index_bytes_per_object']:.0f} B/object)"
                 if "index_bytes" in r else "-")
        shape = r["bucket"].removeprefix("tree-").replace("x", " x ")
        out.append(
            f"| {r['system']} | {_n(r['files'])} ({shape}) | {r['first_walk_s']:.1f} s "
            f"({_n(r['first_walk_lists'])}) | {r['cpu_us_per_entry']:.0f} us | "
            f"{_mb(mem['VmRSS'])} ({_mb(mem.get('RssAnon', 0))} + {_mb(mem.get('RssFile', 0))}) | "
            f"{base} | {index} | {r['remount_walk_s']:.1f} s ({_n(r['remount_walk_lists'])}) | "
            f"{r['stat_rate']:,.0f}/s ({_n(r['stat_requests'])}) |")
    return "\n".join(out)


def flat_table(rows: list[dict[str, Any]]) -> str:
    out = ["| system | flat prefix | first scandir entry | `ls` first line | `ls` done | LISTs | "
           "daemon CPU | daemon RSS after (anon + file) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r["memory_after"]
        out.append(
            f"| {r['system']} | {_n(r['ls_lines'])} | {r['first_scandir_s']:.2f} s | "
            f"{r['ls_first_line_s']:.1f} s | {r['ls_total_s']:.1f} s | {_n(r['lists'])} | "
            f"{r['daemon_cpu_s']:.1f} s | {_mb(mem['VmRSS'])} ({_mb(mem.get('RssAnon', 0))} + "
            f"{_mb(mem.get('RssFile', 0))}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.metadata", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 x 1,000 objects instead of 1,000 x 1,000")
    p.add_argument("--dirs", type=int, help="directories of the tree (default 1000, --quick 200)")
    p.add_argument("--files", type=int, default=1000, help="objects per directory (default 1000)")
    p.add_argument("--flat", type=int, default=200_000, help="objects in the flat prefix (0: skip)")
    p.add_argument("--systems", default="cachefs,rclone")
    p.add_argument("--delay", type=float, default=0.07, help="seconds added to every request")
    p.add_argument("--stat-seconds", type=float, default=10.0)
    p.add_argument("--warm-dirs", type=int, default=10,
                   help="after the remount walk: 'cachefs warm --check' of everything, then "
                        "'cachefs warm' of this many directories, with the daemon's RSS (0: skip)")
    p.add_argument("--cachefs-args", default="", help="extra cachefs mount arguments")
    p.add_argument("--json", type=Path, default=None,
                   help="write the results here (default: results/metadata.json for a full "
                        "run; a --quick run writes none unless asked, so it never replaces "
                        "the recorded figures)")
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args(argv)
    ok, why = fuse_usable()
    if not ok:
        print(f"benchmarks.metadata: cannot mount: {why}", file=sys.stderr)
        return 1
    dirs = args.dirs or (200 if args.quick else 1000)
    tree = f"tree-{dirs}x{args.files}"
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        good, why = available(s)
        if not good:
            print(f"benchmarks.metadata: {s} unavailable: {why}", file=sys.stderr)
            return 1
    extra_of = {"cachefs": args.cachefs_args.split(), "rclone": []}
    results: dict[str, Any] = {"tree": [], "flat": [], "delay_s": args.delay,
                               "command": " ".join(["python -m benchmarks.metadata", *(argv or sys.argv[1:])])}
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="cachefs-metadata-"))
    with synthetic_server(args.delay) as (url, server_pid):
        for s in systems:
            print(f"{s}: walking {tree} ...", file=sys.stderr, flush=True)
            r = run_tree(s, url, tree, run_root / s, extra_of[s], args.stat_seconds,
                         warm_dirs=args.warm_dirs)
            results["tree"].append(r)
            print(f"  {json.dumps(r)}", file=sys.stderr, flush=True)
        if args.flat:
            for s in systems:
                print(f"{s}: listing flat-{args.flat} ...", file=sys.stderr, flush=True)
                r = run_flat(s, url, f"flat-{args.flat}", run_root / (s + "-flat"), extra_of[s])
                results["flat"].append(r)
                print(f"  {json.dumps(r)}", file=sys.stderr, flush=True)
        results["server_cpu_s"] = cpu(server_pid)
    json_path = args.json or (None if args.quick else HERE / "results" / "metadata.json")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    print(f"\n`{results['command']}` ({args.delay * 1000:.0f} ms per request; synthetic server "
          f"CPU {results['server_cpu_s']:.0f} s)\n")
    print(tree_table(results["tree"]))
    if results["flat"]:
        print()
        print(flat_table(results["flat"]))
    warm_rows = [(r["system"], w) for r in results["tree"] for w in (r.get("warm_check"), r.get("warm"))
                 if w]
    if warm_rows:
        print("\n| `cachefs warm` | took | daemon RSS before / peak / after | result |\n|---|---|---|---|")
        for _, w in warm_rows:
            print(f"| {' '.join(w['args'])} | {w['seconds']:.1f} s | {_mb(w['rss_before'])} / "
                  f"{_mb(w['rss_peak'])} / {_mb(w['rss_after'])} | {w['output']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
