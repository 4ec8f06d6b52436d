"""``cachefs status``: what every cachefs mount on this node is doing.

Daemons publish a snapshot of their counters into the runtime registry
(:mod:`cachefs.control.registry`) every few seconds; this command reads those files,
so it needs no network access and works for mounts without a metrics port.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from cachefs.config import format_size
from cachefs.control import registry
from cachefs.errors import ConfigError


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _shared(shared: dict[str, Any] | None, stats: dict[str, float],
            tiers: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """The shared tier's part of the status (None without a shared tier)."""
    if not shared:
        return None
    publishes = tiers.get("shared_publishes", {})
    lookups = tiers.get("shared_lookups", {})
    leases = tiers.get("shared_leases", {})
    return {
        **shared,
        "hit_bytes": int(stats.get("cachefs_shared_get_bytes_total", 0)),
        "lookups": {k: int(v) for k, v in lookups.items()},
        "published_bytes": int(stats.get("cachefs_shared_published_bytes_total", 0)),
        "published_blocks": int(publishes.get("stored", 0)),
        "dropped_blocks": int(publishes.get("dropped_full", 0)
                              + publishes.get("dropped_unavailable", 0)),
        "failed_publishes": int(publishes.get("failed", 0)),
        "queue_blocks": int(stats.get("cachefs_shared_publish_queue_blocks", 0)),
        "queue_bytes": int(stats.get("cachefs_shared_publish_queue_bytes", 0)),
        "breaker_opens": int(stats.get("cachefs_shared_breaker_opens_total", 0)),
        "lease_outcomes": {k: int(v) for k, v in leases.items()},
    }


def describe(info: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The status of one mount as a flat, documented dict (the --json schema)."""
    now = time.time() if now is None else now
    stats: dict[str, float] = info.get("stats", {})
    tiers: dict[str, dict[str, float]] = info.get("tiers") or {}
    hit = stats.get("cachefs_cache_hit_bytes_total", 0.0)
    miss = stats.get("cachefs_cache_miss_bytes_total", 0.0)
    return {
        "mountpoint": info["mountpoint"],
        "source": info["source"],
        "pid": info["pid"],
        "cache_dir": info["cache_dir"],
        "cache_policy": info.get("cache_policy"),
        "cache_used_bytes": int(stats.get("cachefs_cache_used_bytes", 0)),
        "cache_capacity_bytes": int(info.get("cache_size", 0)),
        "cache_blocks": int(stats.get("cachefs_cache_blocks", 0)),
        "hit_ratio": (hit / (hit + miss)) if hit + miss else None,
        "read_bytes": int(stats.get("cachefs_read_bytes_total", 0)),
        # Files opened for the kernel to read from the cache itself (passthrough, the C
        # loop) count whole in the hit bytes at each open, and the daemon sees none of
        # their reads: the hit ratio's bytes beyond those the daemon returned.
        "kernel_opened_bytes": max(0, int(hit + miss - stats.get("cachefs_read_bytes_total", 0))),
        "s3_bytes": int(stats.get("cachefs_s3_bytes_total", 0)),
        "s3_requests": int(stats.get("cachefs_s3_requests_total", 0)),
        "s3_errors": int(stats.get("cachefs_s3_errors_total", 0)),
        "inflight_fetches": int(stats.get("cachefs_inflight_fetches", 0)),
        "inflight_bytes": int(stats.get("cachefs_inflight_bytes", 0)),
        "corrupt_blocks": int(stats.get("cachefs_cache_corrupt_blocks_total", 0)),
        "warm_bytes": int(stats.get("cachefs_warm_bytes_total", 0)),
        "passthrough_enabled": bool(stats.get("cachefs_passthrough_enabled", 0)),
        "native_reads_enabled": bool(stats.get("cachefs_native_reads_enabled", 0)),
        "passthrough_files": int(stats.get("cachefs_passthrough_backing_files", 0)),
        "passthrough_opens": int(stats.get("cachefs_passthrough_opens_total", 0)),
        "warm_target_bytes": int(stats.get("cachefs_warm_target_bytes", 0)),
        "tier_read_bytes": {k: int(v) for k, v in tiers.get("read_bytes", {}).items()},
        "tier_loads": {k: int(v) for k, v in tiers.get("loads", {}).items()},
        "shared": _shared(info.get("shared"), stats, tiers),
        "dead_mounts_cleaned": int(stats.get("cachefs_dead_mounts_cleaned_total", 0)),
        "background_errors": int(stats.get("cachefs_background_errors_total", 0)),
        "background_errors_by_task": {k: int(v) for k, v in
                                      info.get("background_errors", {}).items() if v},
        "control_rejected": int(stats.get("cachefs_control_rejected_total", 0)),
        "control_rejected_by_reason": {k: int(v) for k, v in
                                       info.get("control_rejected", {}).items() if v},
        "sweep_files": int(stats.get("cachefs_sweep_files_total", 0)),
        "sweep_bytes": int(stats.get("cachefs_sweep_bytes_total", 0)),
        "sweep_unread_bytes": int(stats.get("cachefs_sweep_unread_bytes", 0)),
        "sweep_stops_by_reason": {k: int(v) for k, v in info.get("sweep_stops", {}).items() if v},
        "metrics_addr": info.get("metrics_addr"),
        "uptime_seconds": max(0.0, now - float(info.get("started_at", now))),
        "stats_age_seconds": max(0.0, now - float(info.get("updated_at", now))),
        "open_handles": int(stats.get("cachefs_open_file_handles", 0)),
        # A daemon whose mount was detached (umount -l): it runs on, holding its cache
        # directory, until the files open on it are closed; "mountpoint" is where it was.
        "detached": "detached_at" in info,
        "detached_seconds": (max(0.0, now - float(info["detached_at"]))
                             if "detached_at" in info else None),
    }


def _faults(r: dict[str, Any]) -> str:
    """What an on-call engineer looks for: crashes recovered from, housekeeping errors
    (see the log), refused control-socket requests (other users, junk)."""
    def detail(counts: dict[str, int]) -> str:
        return " (" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")" if counts else ""

    parts = [f"{r['background_errors']} background errors{detail(r['background_errors_by_task'])}",
             f"{r['control_rejected']} control requests refused"
             f"{detail(r['control_rejected_by_reason'])}"]
    if r["dead_mounts_cleaned"]:
        parts.append("started over a dead mount (the previous daemon was killed)")
    return ", ".join(parts)


#: Seconds after which a snapshot is too old for a working daemon: it publishes one every
#: second while the mount works and every 10 s while it is idle, so only a daemon that is
#: stopped or hung lets it age this long.
STALE_AFTER = 60.0


def _report_stale(rows: list[dict[str, Any]]) -> bool:
    """Name each mount whose daemon has published nothing for STALE_AFTER seconds (its
    figures are that old); True if any."""
    stale = [r for r in rows if r["stats_age_seconds"] > STALE_AFTER]
    for r in stale:
        print(f"cachefs: error: {r['mountpoint']}: the cachefs daemon (pid {r['pid']}) has "
              f"published no figures for {_duration(r['stats_age_seconds'])} (stopped or "
              "hung? see its log); these are from its last snapshot", file=sys.stderr)
    return bool(stale)


def _mount_is_dead(path: Path, pid: int) -> bool:
    from cachefs.startup import mount_is_dead  # (its imports only when a pid is in doubt)

    return mount_is_dead(path, pid)


def _dead_mounts(mounted: dict[str, str]) -> dict[str, int]:
    """Mount point -> pid of each cachefs mount whose daemon is gone (killed: its registry
    entry is left behind, and the mount answers 'Transport endpoint is not connected'), its
    pid free or taken by now by another process."""
    dead = {}
    for mp in mounted:
        info = registry.entry(Path(mp))
        if info is None or info.get("mountpoint") != mp:
            continue
        try:
            pid = int(info.get("pid", 0))
        except (TypeError, ValueError):
            continue
        # (a pid that names no cachefs daemon is a dead one's, taken by another process
        # by now, or a daemon's in another pid namespace (a container's): the mount says
        # which)
        if not registry.is_daemon(pid) and _mount_is_dead(Path(mp), pid):
            dead[mp] = pid
    return dead


def _report_dead(dead: dict[str, int]) -> None:
    for mp, pid in sorted(dead.items()):
        print(f"cachefs: error: {mp} is a dead cachefs mount (daemon pid {pid} is gone): run "
              f"the same 'cachefs mount' again to recover it, or 'cachefs unmount --lazy {mp}'",
              file=sys.stderr)


def _print_detached(rows: list[dict[str, Any]]) -> None:
    """One entry per daemon that runs on after a lazy unmount: what holds it (its open
    handles), what it holds (the cache directory) and how to end it."""
    for r in rows:
        pid = r["pid"]
        print(f"{r['mountpoint']} (detached)  <-  {r['source']}  (pid {pid}, up "
              f"{_duration(r['uptime_seconds'])}, detached {_duration(r['detached_seconds'])}"
              " ago)")
        print(f"  open    runs on until its {r['open_handles']} open file handle(s) are "
              f"closed (a lazy unmount, umount -l, detached it; figures "
              f"{_duration(r['stats_age_seconds'])} old)")
        print(f"  cache   {r['cache_dir']} is held by it until then (a mount of it is "
              f"refused); 'kill {pid}' ends it now, and reads of those files fail")


def status_main(mountpoint: str | None, *, as_json: bool) -> int:
    if mountpoint == "":  # ("$MNT" unset: not the current directory, as it would resolve)
        raise ConfigError("an empty path: give a cachefs mount point (or none for every "
                          "mount)")
    mounted = registry.cachefs_mounts()
    dead = _dead_mounts(mounted)
    infos = [i for i in registry.all_mounts()
             if i.get("mountpoint") in mounted and i.get("mountpoint") not in dead]
    if mountpoint is not None:
        want = str(registry.as_mounted(mountpoint))
        infos = [i for i in infos if i.get("mountpoint") == want]
        dead = {mp: pid for mp, pid in dead.items() if mp == want}
        if dead:
            _report_dead(dead)
            return 1
    detached = [describe(i) for i in registry.detached_daemons()]
    if mountpoint is not None:
        detached = [r for r in detached if r["mountpoint"] == want]
        if not infos:
            print(f"cachefs: error: {want} is not a live cachefs mount", file=sys.stderr)
            for r in detached:
                print(f"cachefs: its daemon (pid {r['pid']}) runs on detached with "
                      f"{r['open_handles']} open file handle(s), holding {r['cache_dir']}: "
                      "see 'cachefs status'", file=sys.stderr)
            return 1
    rows = [describe(i) for i in infos]
    if as_json:
        # (every mount's row, then the detached daemons' ("detached": true); for one
        # mount point, its mount's row alone)
        json.dump(rows + detached if mountpoint is None else rows[0], sys.stdout, indent=2)
        print()
        _report_dead(dead)
        return 1 if _report_stale(rows) or dead else 0
    if not rows:
        print("no live cachefs mounts" if dead or detached else "no cachefs mounts")
        _print_detached(detached)
        _report_dead(dead)
        return 1 if dead else 0
    for r in rows:
        ratio = "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}%"
        warm = ""
        if r["warm_target_bytes"]:
            warm = (f"  warm {format_size(r['warm_bytes'])} / {format_size(r['warm_target_bytes'])}")
        print(f"{r['mountpoint']}  <-  {r['source']}  (pid {r['pid']}, up "
              f"{_duration(r['uptime_seconds'])})")
        print(f"  cache   {format_size(r['cache_used_bytes'])} / {format_size(r['cache_capacity_bytes'])}"
              f" on disk in {r['cache_dir']} ({r['cache_policy']} policy, {r['cache_blocks']} blocks)")
        kernel = r["kernel_opened_bytes"]
        print(f"  reads   {format_size(r['read_bytes'])} by the daemon"
              + (f" + {format_size(kernel)} of files opened for the kernel to read from the "
                 "cache" if kernel else "")
              + f"; byte hit ratio {ratio}, "
              f"{format_size(r['s3_bytes'])} from S3 in {r['s3_requests']} requests "
              f"({r['s3_errors']} errors)")
        print(f"  now     {r['inflight_fetches']} fetches in flight, "
              f"{format_size(r['inflight_bytes'])} buffered{warm}")
        print(f"  faults  {_faults(r)}")
        by_tier = r["tier_read_bytes"]
        if any(by_tier.values()):
            parts = [f"{name} {format_size(by_tier.get(name, 0))}"
                     for name in ("memory", "disk", "shared", "s3")
                     if name in by_tier and (name != "shared" or r["shared"])]
            print(f"  tiers   read from {', '.join(parts)} (s3 = the origin)")
        sh = r["shared"]
        if sh:
            state = "breaker " + sh["breaker"] + ("" if sh["publishing"] else ", publishing off")
            leases = sh["lease_outcomes"]
            print(f"  shared  {sh['url']} ({state}): {format_size(sh['hit_bytes'])} read, "
                  f"{sh['published_blocks']} blocks published "
                  f"({format_size(sh['published_bytes'])}), queue {sh['queue_blocks']} blocks "
                  f"({format_size(sh['queue_bytes'])}), {sh['dropped_blocks']} dropped; leases "
                  f"won {leases.get('won', 0)}, waited {leases.get('lost_served', 0)}")
            if sh.get("why"):  # (the breaker open or publishing off: the tier's answer)
                print(f"          {sh['why']}")
            if sh.get("leases") is False:  # (the cluster's one copy per block is not kept)
                why = ("the tier does not honour conditional writes (If-None-Match)"
                       if sh.get("conditional_writes") is False else "turned off")
                print(f"          fetch leases off: {why}; nodes that miss a block at "
                      "the same moment each fetch it from the origin")
        if r["sweep_files"] or r["sweep_stops_by_reason"]:
            stops = ", ".join(f"{k} {v}" for k, v in sorted(r["sweep_stops_by_reason"].items()))
            print(f"  sweep   {r['sweep_files']} files ({format_size(r['sweep_bytes'])}) fetched "
                  f"ahead of readers in no predictable order, "
                  f"{format_size(r['sweep_unread_bytes'])} not read yet"
                  + (f"; stopped: {stops}" if stops else ""))
        if r["passthrough_enabled"]:
            print(f"  kernel  reads {r['passthrough_files']} cached files directly (passthrough; "
                  f"{r['passthrough_opens']} opens so far)")
        elif r["native_reads_enabled"]:
            print(f"  kernel  passthrough off; {r['passthrough_files']} verified cached files are "
                  f"read by the native loop ({r['passthrough_opens']} opens so far)")
        else:
            print("  kernel  passthrough off: every read goes through cachefs")
    _print_detached(detached)
    _report_dead(dead)
    return 1 if _report_stale(rows) or dead else 0
