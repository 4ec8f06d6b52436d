"""The benchmark command line.

    python -m benchmarks.run            # full run (minutes), writes benchmarks/RESULTS.md
    python -m benchmarks.run --quick    # tiny data, seconds; what the test suite runs

Runs, on one machine, training reads (a PyTorch DataLoader) over each system
(cachefs, rclone mount, s3fs-fuse, local disk) with the dataset on a SeaweedFS
origin reached co-located (about 1 ms, no cap) or remote (a user-space WAN
emulator: 70 ms RTT, 150 MB/s total, 50 MB/s per connection by default), and
reports throughput over time, epoch times, warm-up vs its physical bound,
link utilisation, GETs vs unique bytes, daemon CPU/RSS and the emulator's own
CPU. Everything started is torn down on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.datasets import Dataset, DatasetSpec, generate, upload, verify_sample
from benchmarks.origin import SeaweedOrigin, raw_get_throughput, weed_binary
from benchmarks.systems import ALL_SYSTEMS, available, mount
from benchmarks.util import drop_caches, fuse_usable, proc_sample, stop_cleanly_on_signals, terminate
from benchmarks.wan import WanLink

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUCKET = "bench"

FULL = {
    "rtt_ms": 70.0,
    "bandwidth_MBps": 150.0,
    "conn_bandwidth_MBps": 50.0,
    "colocated_rtt_ms": 1.0,
    "colocated_bandwidth_MBps": 0.0,
    "images": 5000,
    "shards": 8,
    "shard_size_mb": 128,
    "epochs": 3,
    "workers": 8,
    "epoch_timeout": 120.0,
    "run_timeout": 150.0,
}
QUICK = {
    "rtt_ms": 20.0,
    "bandwidth_MBps": 100.0,
    "conn_bandwidth_MBps": 50.0,
    "colocated_rtt_ms": 1.0,
    "colocated_bandwidth_MBps": 0.0,
    "images": 100,
    "shards": 2,
    "shard_size_mb": 2,
    "epochs": 2,
    "workers": 2,
    "epoch_timeout": 60.0,
    "run_timeout": 90.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny data, RTT 20 ms, 2 epochs: seconds, for the test suite")
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help="comma list of cachefs,cachefs-hint,rclone,s3fs,local (cachefs-hint = cachefs + the sampler's read order)",
    )
    p.add_argument(
        "--datasets",
        default="images,images-inorder,shards",
        help="comma list of images (shuffled), images-inorder (directory order), shards",
    )
    p.add_argument("--links", default="colocated,remote", help="comma list of colocated,remote")
    g = p.add_argument_group("link (defaults: full run / --quick)")
    g.add_argument("--rtt-ms", type=float, help="remote round trip added per request (70 / 20)")
    g.add_argument("--bandwidth-MBps", type=float, help="remote link cap in total per direction, MB/s (150 / 100)")
    g.add_argument("--conn-bandwidth-MBps", type=float, help="remote link cap per connection, MB/s (50 / 50)")
    g.add_argument("--colocated-rtt-ms", type=float, help="co-located round trip (1)")
    g.add_argument("--colocated-bandwidth-MBps", type=float, help="co-located cap, 0 = none (0)")
    g.add_argument("--window-bytes", type=int, default=16 << 20, help="per-connection window of the emulator")
    g = p.add_argument_group("data")
    g.add_argument("--images", type=int, help="image-like files (5000 / 100)")
    g.add_argument("--image-size", type=int, default=110_000, help="mean bytes per image/sample")
    g.add_argument("--classes", type=int, default=100)
    g.add_argument("--shards", type=int, help="tar shards (8 / 2)")
    g.add_argument("--shard-size-mb", type=int, help="MiB per shard (128 / 2)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("reader")
    g.add_argument("--epochs", type=int, help="(3 / 2)")
    g.add_argument("--workers", type=int, help="DataLoader workers (8 / 2)")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--mode", choices=("io", "cpu"), default="io", help="io: read bytes; cpu: + fixed cost per sample")
    g.add_argument("--cpu-ms", type=float, default=2.0, help="per-sample CPU cost in --mode cpu")
    g.add_argument("--epoch-timeout", type=float, help="cut an epoch after this many seconds (120 / 60; 0 = never)")
    g.add_argument(
        "--run-timeout",
        type=float,
        help="per system and link: cut the epoch running and start no more after this many seconds "
        "(150 / 90; 0 = never)",
    )
    g = p.add_argument_group("systems")
    g.add_argument("--cache-size", default="64G", help="cache cap given to every caching system")
    g.add_argument("--cachefs-arg", action="append", default=[], help="extra argument for cachefs mount (repeatable)")
    g = p.add_argument_group("output")
    g.add_argument("--workdir", type=Path, default=HERE / ".work", help="data, origin, mounts (reused between runs)")
    g.add_argument("--out", type=Path, help="results dir (benchmarks/results, or WORKDIR/quick with --quick)")
    g.add_argument("--results-md", type=Path, help="summary file (benchmarks/RESULTS.md; with --quick: OUT/RESULTS.md)")
    args = p.parse_args(argv)
    prof = QUICK if args.quick else FULL
    for k, v in prof.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = args.workdir / "quick" if args.quick else HERE / "results"
    if args.results_md is None:
        args.results_md = args.out / "RESULTS.md" if args.quick else HERE / "RESULTS.md"
    args.systems = [s for s in args.systems.split(",") if s]
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.links = [x for x in args.links.split(",") if x]
    for s in args.systems:
        if s not in ALL_SYSTEMS:
            p.error(f"unknown system {s}")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _versions() -> dict[str, str]:
    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except Exception:
            return "?"

    v = {
        "python": platform.python_version(),
        "weed": out([weed_binary(), "version"]),
        "s3fs": out(["s3fs", "--version"]),
    }
    rc = Path(sys.executable).parent / "rclone"
    v["rclone"] = out([str(rc) if rc.exists() else "rclone", "version"])
    try:  # (its installed version, not an import of torch: that took 1.4 s of every run)
        v["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        v["torch"] = "missing"
    return v


def _machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "mem_gib": round(mem / 2**30, 1), "kernel": platform.release()}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A dataset and the order it is read in; ``name`` labels the results."""

    name: str
    spec: DatasetSpec
    order: str  # "shuffled" | "directory"


def workloads(args: argparse.Namespace) -> list[Workload]:
    images = DatasetSpec("images", args.images, args.image_size, args.classes, seed=args.seed)
    shards = DatasetSpec("shards", args.shards, args.image_size, args.classes, args.shard_size_mb << 20, args.seed)
    known = {
        "images": Workload("images", images, "shuffled"),
        "images-inorder": Workload("images-inorder", images, "directory"),
        "shards": Workload("shards", shards, "shuffled"),
    }
    out = []
    for d in args.datasets:
        if d not in known:
            raise SystemExit(f"unknown dataset {d}: expected one of {', '.join(known)}")
        out.append(known[d])
    return out


def link_params(args: argparse.Namespace, link: str) -> dict[str, float]:
    if link == "remote":
        return {
            "rtt_ms": args.rtt_ms,
            "bandwidth_MBps": args.bandwidth_MBps,
            "conn_bandwidth_MBps": args.conn_bandwidth_MBps,
        }
    return {
        "rtt_ms": args.colocated_rtt_ms,
        "bandwidth_MBps": args.colocated_bandwidth_MBps,
        "conn_bandwidth_MBps": args.colocated_bandwidth_MBps,
    }


def run_one(
    args: argparse.Namespace, origin: SeaweedOrigin, wl: Workload, ds: Dataset, manifest: Path, system: str, link: str
) -> dict[str, Any]:
    run_dir = args.workdir / "runs" / f"{ds.spec.id}-{wl.order}" / link / system
    run_dir.mkdir(parents=True, exist_ok=True)
    lp = link_params(args, link) if system != "local" else {}
    result: dict[str, Any] = {
        "system": system,
        "link": link,
        "dataset": wl.name,
        "dataset_id": ds.spec.id,
        "order": wl.order,
        "link_params": lp,
    }
    drop_caches()
    with contextlib.ExitStack() as stack:
        wan = None
        endpoint = origin.endpoint
        if system != "local":
            wan = stack.enter_context(
                WanLink(
                    origin.s3_port,
                    lp["rtt_ms"],
                    lp["bandwidth_MBps"],
                    lp["conn_bandwidth_MBps"],
                    window_bytes=args.window_bytes,
                    log_path=str(run_dir / "wan.log"),
                )
            )
            endpoint = wan.endpoint
        extra = args.cachefs_arg if system.startswith("cachefs") else None
        m = stack.enter_context(
            mount(
                system,
                endpoint=endpoint,
                bucket=BUCKET,
                prefix=ds.prefix,
                run_dir=run_dir,
                local_root=ds.local_root,
                cache_size=args.cache_size,
                extra=extra,
            )
        )
        result["mount_seconds"] = m.mount_seconds
        result["command"] = m.command
        out = run_dir / "reader.json"
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        cmd = [
            sys.executable, "-m", "benchmarks.reader",
            "--root", str(m.root), "--manifest", str(manifest), "--out", str(out),
            "--epochs", str(args.epochs), "--workers", str(args.workers), "--batch-size", str(args.batch_size),
            "--mode", args.mode, "--cpu-ms", str(args.cpu_ms), "--seed", str(args.seed), "--order", wl.order,
            "--epoch-timeout", str(args.epoch_timeout), "--run-timeout", str(args.run_timeout),
        ]  # fmt: skip
        if wan is not None:
            result["proxy_stats_url"] = f"http://127.0.0.1:{wan.control_port}/stats"
            cmd += ["--stats-url", result["proxy_stats_url"]]
        if m.metrics_url:
            result["metrics_url"] = m.metrics_url
            cmd += ["--stats-url", m.metrics_url]
        if m.pid:
            cmd += ["--pid", str(m.pid)]
        if system == "cachefs-hint":
            cmd += ["--hint"]
        result["reader_command"] = cmd
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        origin_cpu0 = origin.cpu_seconds()
        t0 = time.monotonic()
        reader = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True, stdin=subprocess.DEVNULL)
        budget = (args.run_timeout or args.epochs * (args.epoch_timeout or 900)) + 120 * args.epochs + 120
        try:
            rc = reader.wait(budget)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            terminate(reader, timeout=5)
        result["wall_seconds"] = time.monotonic() - t0
        result["origin_cpu_s"] = origin.cpu_seconds() - origin_cpu0
        if rc != 0 or not out.exists():
            raise RuntimeError(f"reader failed (exit {rc}) for {system}/{link}/{wl.name}")
        result["reader"] = json.loads(out.read_text())
        if wan is not None:
            result["proxy_final"] = wan.stats()
            result["proxy_cpu_s"] = result["proxy_final"]["cpu_s"]
            ps = proc_sample(wan.pid)
            if ps:
                result["proxy_cpu_s"] = ps.cpu_s
        if m.pid:
            s = proc_sample(m.pid)
            result["daemon_final"] = None if s is None else {"cpu_s": s.cpu_s, "peak_rss": s.peak_rss_bytes}
    return result


def link_selfcheck(args: argparse.Namespace, origin: SeaweedOrigin, objects: list[tuple[str, int]]) -> dict[str, Any]:
    """Raw ranged-GET throughput directly and through each emulated link, with the emulator's CPU."""
    out: dict[str, Any] = {}
    cap = 512 << 20 if not args.quick else 32 << 20
    drop_caches()
    out["origin_direct_cold"] = raw_get_throughput(origin.s3_port, BUCKET, objects, conns=4, max_bytes=cap)
    out["origin_direct"] = raw_get_throughput(origin.s3_port, BUCKET, objects, conns=4, max_bytes=cap)
    for link in args.links:
        lp = link_params(args, link)
        with WanLink(
            origin.s3_port,
            lp["rtt_ms"],
            lp["bandwidth_MBps"],
            lp["conn_bandwidth_MBps"],
            window_bytes=args.window_bytes,
        ) as w:
            c0 = proc_sample(w.pid).cpu_s  # type: ignore[union-attr]
            r = raw_get_throughput(w.port, BUCKET, objects, conns=8, max_bytes=cap // (1 if link != "remote" else 2))
            c1 = proc_sample(w.pid).cpu_s  # type: ignore[union-attr]
            st = w.stats()
        r["proxy_cpu_s"] = c1 - c0
        r["proxy_cpu_s_per_GB"] = (c1 - c0) / (r["bytes"] / 1e9)
        r["proxy_get_count"] = st["get_count"]
        out[f"through_{link}"] = r
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_cleanly_on_signals()
    started = dt.datetime.now(dt.UTC)
    command = "python -m benchmarks.run " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    systems = []
    ok_fuse, why = fuse_usable()
    for s in args.systems:
        if s != "local" and not ok_fuse:
            skipped[s] = why
            continue
        ok, reason = available(s)
        if ok:
            systems.append(s)
        else:
            skipped[s] = reason
    for s, r in skipped.items():
        log(f"skipping {s}: {r}")
    if os.geteuid() != 0:
        log("not root: page cache cannot be dropped between epochs (later epochs may measure RAM)")
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    info: dict[str, Any] = {}
    try:
        with SeaweedOrigin(args.workdir / "origin", bucket=BUCKET) as origin:
            log(f"origin: weed mini at {origin.endpoint} (pid {origin.pid})")
            s3 = origin.client()
            loaded: dict[str, tuple[Dataset, Path]] = {}  # one generate/upload per spec
            datasets: list[tuple[Workload, Dataset, Path]] = []
            for wl in workloads(args):
                if wl.spec.id not in loaded:
                    ds = generate(wl.spec, args.workdir, log=log)
                    if not upload(ds, s3, BUCKET, log=log):
                        log(f"origin already holds {wl.spec.id} (manifest matches): upload skipped")
                    verify_sample(ds, s3, BUCKET)
                    mpath = args.workdir / "manifests" / f"{wl.spec.id}.json"
                    mpath.parent.mkdir(exist_ok=True)
                    mpath.write_text(json.dumps(ds.manifest()))
                    loaded[wl.spec.id] = (ds, mpath)
                datasets.append((wl, *loaded[wl.spec.id]))
            biggest = max((d for d, _ in loaded.values()), key=lambda d: d.total_bytes // len(d.files))
            objs = [(f"{biggest.prefix}/{p}", s) for p, s in biggest.files]
            info["selfcheck"] = link_selfcheck(args, origin, objs * max(1, (64 << 20) // max(1, biggest.total_bytes)))
            sc = info["selfcheck"]
            rem = sc.get("through_remote", {})
            log(
                f"origin raw GET {sc['origin_direct']['MBps']:.0f} MB/s "
                f"({sc['origin_direct_cold']['MBps']:.0f} MB/s from a cold page cache); "
                f"through co-located link {sc.get('through_colocated', {}).get('MBps', 0):.0f} MB/s; "
                f"through remote link {rem.get('MBps', 0):.0f} MB/s "
                f"(emulator {rem.get('proxy_cpu_s_per_GB', 0):.2f} CPU s/GB)"
            )
            for wl, ds, mpath in datasets:
                for system in systems:
                    links = ["local"] if system == "local" else args.links
                    for link in links:
                        log(f"{wl.name} / {system} / {link}: {len(ds.files)} files, {ds.total_bytes / 1e6:.0f} MB")
                        try:
                            r = run_one(args, origin, wl, ds, mpath, system, link)
                        except KeyboardInterrupt:
                            raise
                        except Exception as e:
                            log(f"  FAILED: {e}")
                            failures.append(
                                {"system": system, "link": link, "dataset": wl.name, "error": str(e)[-2000:]}
                            )
                            continue
                        runs.append(r)
                        raw = args.workdir / "runs" / f"{wl.name}__{link}__{system}.json"
                        raw.write_text(json.dumps(r))
    except KeyboardInterrupt:
        log("interrupted: everything started has been torn down")
        return 130
    finished = dt.datetime.now(dt.UTC)
    ms = report.summarize(runs) if runs else []
    report.write_series(runs, args.out)
    summary = {
        "command": command,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": (finished - started).total_seconds(),
        "machine": _machine(),
        "versions": _versions(),
        "params": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("workdir", "out", "results_md")
        },
        "skipped": skipped,
        "failures": failures,
        "selfcheck": info.get("selfcheck"),
        "runs": ms,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if runs:
        report.plot(
            runs,
            args.out / "throughput.png",
            f"{'quick' if args.quick else 'full'} run: remote = {args.rtt_ms:g} ms RTT, "
            f"{args.bandwidth_MBps:g} MB/s ({args.conn_bandwidth_MBps:g}/conn); "
            f"co-located = {args.colocated_rtt_ms:g} ms",
        )
    write_results_md(args, summary, ms)
    log(f"results: {args.out} and {args.results_md}")
    print(report.table(ms))
    return 1 if failures else 0


def write_results_md(args: argparse.Namespace, summary: dict[str, Any], ms: list[dict[str, Any]]) -> None:
    args.results_md.parent.mkdir(parents=True, exist_ok=True)
    old = args.results_md.read_text() if args.results_md.exists() else ""
    plot = os.path.relpath(args.out / "throughput.png", args.results_md.parent)
    args.results_md.write_text(report.render(summary, ms, plot, keep_notes_from=old))


if __name__ == "__main__":
    sys.exit(main())
