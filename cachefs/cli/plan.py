"""``cachefs plan``: what moving a training job next to a remote bucket will cost.

Inputs are the dataset, the cache, the link (measured with ``cachefs probe`` or
given) and the job's demand. Notation (anchors of the design): dataset S bytes
in D files, cache fraction c (below), link goodput B, demand R,
request latency L, requests in flight Q, epochs E, allocation unit u.

* Cache footprint F: ``--cache-size`` caps the disk space the cache files take, and a
  file takes its size rounded up to the cache file system's allocation unit u (4 KiB
  on ext4, XFS, btrfs, tmpfs; ``--allocation-unit``). Blocks of the block size (a power
  of two >= 64 KiB, so whole units) round only a file's last one, so the block size
  does not matter. The plan knows only the mean size S/D, so F = D x max(u, S/D + u/2)
  is an estimate for a spread of sizes (:func:`footprint`): 1 M files of 2 KB are 2 GB
  of data but 4.1 GB of cache; 100 MB files add 0.002 %.
* Cache fraction c = min(1, cache / F): the share of the files that stay cached.
* Hit ratio per epoch with a fresh random permutation each epoch:
  ``keep`` (admit until full, then keep) h = c; ``lru`` h = c + (1-c) ln(1-c).
  Both are 1 once the dataset fits (c = 1).
* Remote bytes per epoch after the first: (1-h) S. Only misses cross the link,
  so the steady rate is min(R, min(B, latency bound) / (1-h)) (R when h = 1).
* Latency bound on reading files one request each: Q x (S/D) / L. Without
  daemon-side prefetch Q is the number of DataLoader workers; with directory
  order or a read-order hint cachefs keeps up to its connection limit in flight.
* First epoch (cold): min(R, B, latency bound). Warm-up lower bound: S / B when
  the dataset fits in the cache (F <= cache).
* Co-located parity in steady state needs min(B/(1-h), latency bound) >= R,
  i.e. c >= 1 - B/R for the keep policy.

Cluster (``--nodes N``): N nodes share the one link B, each reading R; with a
DistributedSampler every epoch is a fresh permutation split into N disjoint
parts, so a node reads S/N per epoch, a different S/N each time.

* Without a shared tier, each node keeps what it read (keep policy, capped at
  c): before epoch k a node holds f_k = min(c, 1 - (1-1/N)^(k-1)) of the
  dataset, and the cluster pulls (1 - f_k) S across regions in epoch k (at
  N = 4 over 3 epochs: 1 + 0.75 + 0.5625 = 2.31 S).
* With a shared tier holding c_s = min(1, shared / S) of the dataset: S in
  epoch 1, then (1 - c_s) S per epoch. The tier stores each block as an object of its
  exact length, so c_s compares bytes, not the footprint.
* Epoch time: max(S / (N R), cross-region bytes of the epoch / B).
* Pre-warming every node: N S over the link (N S / B); ``cachefs warm --shard``
  on N nodes with a shared tier: S (S / B).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

from cachefs.config import parse_duration, parse_size
from cachefs.errors import ConfigError

#: The allocation unit of the usual cache file systems (ext4, XFS, btrfs, tmpfs): the
#: cache's own (``cachefs.cache.objectfiles``: never below a page, a power of two up to
#: 64 KiB) is taken from ``statvfs`` at mount time, which the plan cannot see; repeated
#: here because the CLI does not import the cache layer.
ALLOCATION_UNIT = 4096
_UNIT_RANGE = (4096, 64 << 10)
#: The footprint is printed when it exceeds the dataset by more than this fraction.
_FOOTPRINT_NOTE = 0.01


@dataclasses.dataclass(frozen=True)
class Inputs:
    dataset_bytes: int
    cache_bytes: int
    bandwidth: float  # bytes/s
    latency: float  # seconds
    demand: float  # bytes/s
    files: int
    in_flight: int
    workers: int
    epochs: int
    nodes: int = 1
    shared_bytes: int | None = None  # shared tier capacity (None: holds the dataset)
    allocation_unit: int = ALLOCATION_UNIT  # the cache file system's (bytes)


def footprint(dataset_bytes: int, files: int, unit: int) -> int:
    """The disk space ``files`` files of ``dataset_bytes`` take in the cache, counted as
    ``--cache-size`` counts it: each file rounded up to ``unit`` u (only a file's last
    block is short of the block size, a multiple of u).

    Only the mean size m is known, so this estimates ``max(u, m + u/2)`` a file. Whatever
    the spread of sizes, the true value lies in [max(u, m), m + u). A spread of sizes
    fills a file's last unit to any fraction alike, wasting u/2 on average: m + u/2, the
    middle of that range, so off by at most u/2 a file. Files of half a unit or less on
    average are nearly all under a unit and take exactly one: u. ``ceil(m/u) x u`` is
    exact only when every file has the mean's size, and off by up to a unit a file for a
    spread (a mean of exactly 4 KiB would count no waste at all)."""
    n = max(1, files)
    return max(dataset_bytes, round(n * max(unit, dataset_bytes / n + unit / 2)))


def hit_ratio(policy: str, c: float) -> float:
    if c >= 1:
        return 1.0
    if policy == "keep":
        return c
    if policy == "lru":
        return c + (1 - c) * math.log(1 - c) if c > 0 else 0.0
    raise ValueError(policy)


def plan(inp: Inputs) -> dict[str, Any]:
    S, B, R, L = inp.dataset_bytes, inp.bandwidth, inp.demand, inp.latency
    F = footprint(S, inp.files, inp.allocation_unit)
    c = min(1.0, inp.cache_bytes / F) if S else 1.0
    mean_file = S / max(1, inp.files)
    latency_bound_workers = inp.workers * mean_file / L if L > 0 else math.inf
    latency_bound_prefetch = inp.in_flight * mean_file / L if L > 0 else math.inf
    first_epoch_rate = min(R, B, latency_bound_prefetch)
    result: dict[str, Any] = {
        "cache_fraction": c,
        "footprint_bytes": F,
        "mean_file_bytes": mean_file,
        "latency_bound_workers_bytes_per_s": latency_bound_workers,
        "latency_bound_prefetch_bytes_per_s": latency_bound_prefetch,
        "first_epoch_seconds": S / first_epoch_rate if first_epoch_rate else math.inf,
        "first_epoch_bytes_per_s": first_epoch_rate,
        "warmup_lower_bound_seconds": S / B if B else math.inf,
        "parity_cache_fraction_needed": max(0.0, 1 - B / R) if R else 0.0,
        "policies": {},
    }
    for policy in ("keep", "lru"):
        h = hit_ratio(policy, c)
        # Only misses cross the link: the remote share (1-h) x rate is bounded by the link
        # and by the latency bound of the requests in flight.
        remote_bound = min(B, latency_bound_prefetch)
        rate = min(R, remote_bound / (1 - h)) if h < 1 else R
        epoch_s = S / rate if rate else math.inf
        total = result["first_epoch_seconds"] + max(0, inp.epochs - 1) * epoch_s
        result["policies"][policy] = {
            "hit_ratio": h,
            "remote_bytes_per_epoch": (1 - h) * S,
            "steady_bytes_per_s": rate,
            "steady_epoch_seconds": epoch_s,
            "job_seconds": total,
            "colocated_job_seconds": inp.epochs * S / R if R else math.inf,
            "parity": rate >= R * 0.999,
        }
    return result


def cluster(inp: Inputs) -> dict[str, Any]:
    """Cross-region bytes and times of a DistributedSampler job on ``inp.nodes`` nodes,
    without and with a shared tier (formulas in the module docstring)."""
    S, N, B, R = inp.dataset_bytes, max(1, inp.nodes), inp.bandwidth, inp.demand
    c = min(1.0, inp.cache_bytes / footprint(S, inp.files, inp.allocation_unit)) if S else 1.0
    # The tier's objects are blocks of their exact length: no rounding to compare.
    cs = min(1.0, (S if inp.shared_bytes is None else inp.shared_bytes) / S) if S else 1.0
    epochs = []
    for k in range(1, inp.epochs + 1):
        held = min(c, 1 - (1 - 1 / N) ** (k - 1))
        without = (1 - held) * S
        with_tier = S if k == 1 else (1 - cs) * S
        compute = S / (N * R) if R else 0.0
        epochs.append({
            "epoch": k,
            "cross_region_bytes_without": without,
            "cross_region_bytes_with": with_tier,
            "seconds_without": max(compute, without / B if B else math.inf),
            "seconds_with": max(compute, with_tier / B if B else math.inf),
        })
    total_without = sum(e["cross_region_bytes_without"] for e in epochs)
    total_with = sum(e["cross_region_bytes_with"] for e in epochs)
    return {
        "nodes": N,
        "shared_fraction": cs,
        "epochs": epochs,
        "cross_region_bytes_without": total_without,
        "cross_region_bytes_with": total_with,
        "job_seconds_without": sum(e["seconds_without"] for e in epochs),
        "job_seconds_with": sum(e["seconds_with"] for e in epochs),
        "warmup_bytes_without": N * S,
        "warmup_bytes_with": S,
        "warmup_seconds_without": N * S / B if B else math.inf,
        "warmup_seconds_with": S / B if B else math.inf,
    }


def render_cluster(inp: Inputs, r: dict[str, Any]) -> str:
    S = inp.dataset_bytes
    lines = [
        "",
        f"cluster of N = {r['nodes']} nodes on one link, DistributedSampler (each epoch every "
        f"node reads a fresh 1/N); shared tier holds {r['shared_fraction']:.0%} of the dataset",
        f"{'epoch':>5}{'cross-region without':>22}{'with shared tier':>18}"
        f"{'epoch time without':>20}{'with':>10}",
    ]
    for e in r["epochs"]:
        lines.append(
            f"{e['epoch']:>5}{_h(e['cross_region_bytes_without']):>14} "
            f"({e['cross_region_bytes_without'] / S:.2f} S){_h(e['cross_region_bytes_with']):>10} "
            f"({e['cross_region_bytes_with'] / S:.2f} S){_t(e['seconds_without']):>20}"
            f"{_t(e['seconds_with']):>10}")
    lines += [
        f"total{_h(r['cross_region_bytes_without']):>14} "
        f"({r['cross_region_bytes_without'] / S:.2f} S){_h(r['cross_region_bytes_with']):>10} "
        f"({r['cross_region_bytes_with'] / S:.2f} S){_t(r['job_seconds_without']):>20}"
        f"{_t(r['job_seconds_with']):>10}",
        f"pre-warming: every node = N S = {_h(r['warmup_bytes_without'])} across regions "
        f"({_t(r['warmup_seconds_without'])}); 'cachefs warm --shard I/N' on the N nodes = S "
        f"= {_h(r['warmup_bytes_with'])} ({_t(r['warmup_seconds_with'])})",
    ]
    return "\n".join(lines)


def _h(n: float) -> str:
    if n == math.inf:
        return "inf"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _t(s: float) -> str:
    if s == math.inf:
        return "never"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def render(inp: Inputs, r: dict[str, Any]) -> str:
    c, S, F = r["cache_fraction"], inp.dataset_bytes, r["footprint_bytes"]
    rounded = F > S * (1 + _FOOTPRINT_NOTE)
    lines = [
        f"dataset S = {_h(S)} in D = {inp.files} files (mean {_h(r['mean_file_bytes'])}); "
        f"cache = {_h(inp.cache_bytes)} -> c = {'cache / F = ' if rounded else ''}{c:.3f}",
    ]
    if rounded:
        u = inp.allocation_unit
        lines.append(
            f"cache footprint F = {_h(F)} for S = {_h(S)} of data (files round up to "
            f"u = {u >> 10} KiB on disk; F = D x max(u, S/D + u/2) estimates a spread of sizes)")
    lines += [
        f"link B = {_h(inp.bandwidth)}/s, latency L = {inp.latency * 1000:.0f} ms; demand R = "
        f"{_h(inp.demand)}/s; {inp.epochs} epochs",
        "",
        f"latency bound, one file per DataLoader worker: Q x S/D / L = {inp.workers} x "
        f"{_h(r['mean_file_bytes'])} / {inp.latency * 1000:.0f} ms = "
        f"{_h(r['latency_bound_workers_bytes_per_s'])}/s",
        f"latency bound, cachefs prefetch (directory order or read-order hint, Q = "
        f"{inp.in_flight}): {_h(r['latency_bound_prefetch_bytes_per_s'])}/s",
        f"first epoch (cold): S / min(R, B, prefetch bound) = "
        f"{_t(r['first_epoch_seconds'])} at {_h(r['first_epoch_bytes_per_s'])}/s",
        f"warm-up lower bound S / B = {_t(r['warmup_lower_bound_seconds'])}",
        f"co-located parity needs c >= 1 - B/R = {r['parity_cache_fraction_needed']:.3f}",
        "",
        f"{'policy':<8}{'hit ratio':>11}{'remote/epoch':>14}{'steady rate':>14}"
        f"{'job time':>12}{'co-located':>12}  parity",
    ]
    for policy, p in r["policies"].items():
        formula = "h = c" if policy == "keep" else "h = c + (1-c) ln(1-c)"
        lines.append(
            f"{policy:<8}{p['hit_ratio']:>11.3f}{_h(p['remote_bytes_per_epoch']):>14}"
            f"{_h(p['steady_bytes_per_s']) + '/s':>14}{_t(p['job_seconds']):>12}"
            f"{_t(p['colocated_job_seconds']):>12}  {'yes' if p['parity'] else 'no'}"
            f"   ({formula}; rate = min(R, min(B, prefetch bound) / (1-h)))")
    best = max(r["policies"].items(), key=lambda kv: kv[1]["steady_bytes_per_s"])
    lines.append("")
    needed = r["parity_cache_fraction_needed"]
    lines.append(f"recommended policy: {best[0]}" + (
        "" if best[1]["parity"] else
        f" (no parity: grow the cache to >= {needed:.0%} of the "
        + (f"cache footprint, {_h(needed * F)}" if rounded else "dataset")
        + ", or the link)"))
    return "\n".join(lines)


def _rate(value: str) -> float:
    """'150MB/s', '1.2GB', '10Gbit' -> bytes/s (decimal units, as links are quoted)."""
    text = value.strip().lower().removesuffix("/s").removesuffix("ps")
    bits = text.endswith(("bit", "b")) and not text.endswith(("byte", "kb", "mb", "gb", "tb"))
    for suffix in ("bits", "bit", "bytes", "byte", "b"):
        if text.endswith(suffix):
            text = text[:-len(suffix)]
            break
    mult = 1.0
    for unit, m in (("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12)):
        if text.endswith(unit):
            text, mult = text[:-1], m
            break
    try:
        n = float(text) * mult
    except ValueError:
        raise ConfigError(f"invalid rate {value!r}: expected e.g. 150MB/s or 10Gbit") from None
    return n / 8 if bits else n


def _probe_figure(probe: Any, path: str, key: str, *, positive: bool) -> float:
    """``probe[key]`` of a 'cachefs probe --json' file: a finite number (above zero if
    ``positive``, else at least zero), or a one-line error naming the file."""
    value = probe.get(key) if isinstance(probe, dict) else None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise ConfigError(f"probe results {path!r}: {key} is {value!r}, not a measured figure "
                          "(write the file with 'cachefs probe --json')")
    return float(value)


def _finite(flag: str, value: float, *, positive: bool = True) -> float:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ConfigError(f"{flag} must be a finite number" + (" above zero" if positive else ""))
    return value


def plan_main(args: Any) -> int:
    bandwidth = _finite("--bandwidth", _rate(args.bandwidth)) if args.bandwidth else None
    latency = (_finite("--latency", parse_duration(args.latency), positive=False)
               if args.latency else None)
    if args.probe:
        try:
            with open(args.probe) as f:
                probe = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read probe results {args.probe!r}: {exc}") from None
        if bandwidth is None:
            bandwidth = _probe_figure(probe, args.probe, "parallel_bytes_per_s", positive=True)
        if latency is None:
            latency = _probe_figure(probe, args.probe, "get_latency_p50_s", positive=False)
    if bandwidth is None or latency is None:
        raise ConfigError("give --bandwidth and --latency, or --probe FILE from "
                          "'cachefs probe --json'")
    _finite("--demand", _rate(args.demand))
    for flag, number in (("--workers", args.workers), ("--in-flight", args.in_flight)):
        if number < 1:
            raise ConfigError(f"{flag} must be at least 1")
    if args.files < 0:
        raise ConfigError("--files must not be negative (0: from --mean-file-size)")
    if args.mean_file_size and parse_size(args.mean_file_size) <= 0:
        raise ConfigError("--mean-file-size must be positive")
    dataset = parse_size(args.dataset_size)
    if dataset <= 0:
        raise ConfigError("--dataset-size must be positive")
    unit = parse_size(args.allocation_unit)
    if not _UNIT_RANGE[0] <= unit <= _UNIT_RANGE[1] or unit & (unit - 1):
        raise ConfigError(f"--allocation-unit {args.allocation_unit}: must be a power of two "
                          "from 4K to 64K (the cache's is its file system's, at least a page)")
    inp = Inputs(
        dataset_bytes=dataset, cache_bytes=parse_size(args.cache_size),
        bandwidth=bandwidth, latency=latency, demand=_rate(args.demand),
        files=args.files or max(1, dataset // (parse_size(args.mean_file_size)
                                               if args.mean_file_size else 110_000)),
        in_flight=args.in_flight, workers=args.workers, epochs=args.epochs,
        nodes=args.nodes,
        shared_bytes=parse_size(args.shared_cache_size) if args.shared_cache_size else None,
        allocation_unit=unit)
    if inp.demand <= 0 or inp.bandwidth <= 0:
        raise ConfigError("--demand and --bandwidth must be positive")
    if inp.nodes < 1 or inp.epochs < 1:
        raise ConfigError("--nodes and --epochs must be at least 1")
    result = plan(inp)
    if inp.nodes > 1 or inp.shared_bytes is not None:
        result["cluster"] = cluster(inp)
    if args.json:
        json.dump({"inputs": dataclasses.asdict(inp), **result}, sys.stdout, indent=2,
                  default=str)
        print()
    else:
        print(render(inp, result))
        if "cluster" in result:
            print(render_cluster(inp, result["cluster"]))
    return 0
