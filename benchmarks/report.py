"""Metrics, warm-up detection, plot and the RESULTS.md table."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

WARM_TOLERANCE = 0.05  # "within 5% of the co-located steady state"
SMOOTH_S = 3  # centred moving average (seconds) for warm-up detection


# ---------------------------------------------------------------- helpers
def _in_epoch_seconds(reader: dict[str, Any]) -> list[tuple[int, float, float, int]]:
    """(second, samples, bytes, epoch) for seconds lying entirely inside an epoch."""
    spans = [(e["start"], e["end"]) for e in reader["epochs"]]
    out = []
    for s, n, b in reader["series"]:
        for i, (a, z) in enumerate(spans):
            if a <= s and s + 1 <= z:
                out.append((s, n, b, i))
                break
    return out


def steady_state(reader: dict[str, Any]) -> dict[str, float] | None:
    """Throughput over the epochs after the first (None with a single epoch)."""
    later = [e for e in reader["epochs"][1:] if e["seconds"] > 0]
    if not later:
        return None
    secs = sum(e["seconds"] for e in later)
    return {
        "samples_per_s": sum(e["samples"] for e in later) / secs,
        "MBps": sum(e["bytes"] for e in later) / secs / 1e6,
        "seconds_per_epoch": secs / len(later),
    }


def warmup_time(reader: dict[str, Any], reference_sps: float) -> float | None:
    """Seconds from the first epoch's start until the (smoothed) per-second
    samples/s stays >= (1 - 5%) of ``reference_sps`` for the rest of the run.
    None when that never happens. Gaps between epochs are ignored."""
    pts = _in_epoch_seconds(reader)
    if not pts or reference_sps <= 0:
        return None
    thr = (1 - WARM_TOLERANCE) * reference_sps
    half = SMOOTH_S // 2
    smooth = []
    for i, (_, _n, _, ep) in enumerate(pts):
        # centred moving average that never reaches into another epoch
        w = [p[1] for p in pts[max(0, i - half) : i + half + 1] if p[3] == ep]
        smooth.append(sum(w) / len(w))
    last_bad = -1
    for i, v in enumerate(smooth):
        if v < thr:
            last_bad = i
    if last_bad == len(smooth) - 1:
        return None
    if last_bad < 0:
        return float(pts[0][0])
    # report the left edge of the first good window (within its epoch)
    j = last_bad + 1
    k = max(j - half, 0)
    while pts[k][3] != pts[j][3]:
        k += 1
    return float(max(pts[k][0], pts[j][0] - half))


def _delta(snaps: list[dict[str, Any]], key: str, field: str, i: int, j: int) -> float | None:
    try:
        return snaps[j][key][field] - snaps[i][key][field]
    except (KeyError, TypeError, IndexError):
        return None


_PROM = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def parse_prom(text: str, prefix: str = "cachefs_") -> dict[str, float]:
    out: dict[str, float] = {}
    if not isinstance(text, str):
        return out
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _PROM.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def prom_sum(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    hit = False
    total = 0.0
    for k, v in metrics.items():
        base, _, lab = k.partition("{")
        if base != name:
            continue
        if all(f'{lk}="{lv}"' in lab for lk, lv in labels.items()):
            total += v
            hit = True
    return total if hit else None


# ---------------------------------------------------------------- per run
def run_metrics(run: dict[str, Any]) -> dict[str, Any]:
    """Everything the table needs from one (dataset, link, system) run."""
    r = run["reader"]
    eps = r["epochs"]
    m: dict[str, Any] = {
        "system": run["system"],
        "link": run["link"],
        "dataset": run["dataset"],
        "dataset_bytes": r["expected_bytes"],
        "dataset_samples": r["expected_samples"],
        "epochs": [
            {
                "seconds": e["seconds"],
                "samples_per_s": e["samples"] / e["seconds"] if e["seconds"] else 0,
                "MBps": e["bytes"] / e["seconds"] / 1e6 if e["seconds"] else 0,
                "complete": e["complete"],
                "truncated": e["truncated"],
            }
            for e in eps
        ],
        "first_epoch_s": eps[0]["seconds"] if eps else None,
        "first_epoch_complete": eps[0]["complete"] if eps else False,
        "later_epoch_s": (sum(e["seconds"] for e in eps[1:]) / len(eps[1:])) if len(eps) > 1 else None,
        "steady": steady_state(r),
        "list_seconds": r.get("list_seconds"),
        "mount_seconds": run.get("mount_seconds"),
    }
    snaps = r.get("snapshots", [])
    proxy_url = run.get("proxy_stats_url")
    bw = run.get("link_params", {}).get("bandwidth_MBps") or 0
    if proxy_url and snaps:
        b0 = _delta(snaps, proxy_url, "bytes_to_client", 0, 1)
        m["first_epoch_link_MBps"] = b0 / eps[0]["seconds"] / 1e6 if (b0 is not None and eps[0]["seconds"]) else None
        m["first_epoch_link_util"] = (
            (m["first_epoch_link_MBps"] / bw) if (bw and m["first_epoch_link_MBps"] is not None) else None
        )
        m["gets_per_epoch"] = [_delta(snaps, proxy_url, "get_count", 2 * i, 2 * i + 1) for i in range(len(eps))]
        m["link_bytes_per_epoch"] = [
            _delta(snaps, proxy_url, "bytes_to_client", 2 * i, 2 * i + 1) for i in range(len(eps))
        ]
    mc = [s.get("machine_cpu") for s in snaps if s.get("machine_cpu")]
    if len(mc) >= 2 and mc[-1]["total"] > mc[0]["total"]:
        # whole-machine CPU use during the run (all processes, both cores)
        m["machine_cpu_busy"] = (mc[-1]["busy"] - mc[0]["busy"]) / (mc[-1]["total"] - mc[0]["total"])
    px = run.get("proxy_final") or {}
    if px:
        m.update(
            {
                "get_count": px.get("get_count"),
                "head_count": px.get("head_count"),
                "list_count": px.get("list_count"),
                "get_bytes": px.get("get_transferred_bytes"),
                "get_requested_bytes": px.get("get_requested_bytes"),
                "unique_bytes": px.get("unique_bytes"),
                "duplication": (px["get_transferred_bytes"] / px["unique_bytes"]) if px.get("unique_bytes") else None,
                "connections": px.get("connections"),
                "proxy_cpu_s": run.get("proxy_cpu_s"),
            }
        )
    pid_key = next((k for k in (snaps[0] if snaps else {}) if k.startswith("pid:")), None)
    if pid_key:
        vals = [s.get(pid_key) for s in snaps if s.get(pid_key)]
        if vals:
            m["daemon_cpu_s"] = vals[-1]["cpu_s"] - vals[0]["cpu_s"]
            m["daemon_peak_rss"] = max(v["peak_rss"] for v in vals)
    if run.get("daemon_final"):
        m["daemon_peak_rss"] = max(m.get("daemon_peak_rss", 0), run["daemon_final"]["peak_rss"])
    m["origin_cpu_s"] = run.get("origin_cpu_s")
    mu = run.get("metrics_url")
    if mu and snaps:
        first, last = parse_prom(snaps[0].get(mu, "")), parse_prom(snaps[-1].get(mu, ""))
        g = prom_sum(last, "cachefs_s3_requests_total", op="get")
        g0 = prom_sum(first, "cachefs_s3_requests_total", op="get") or 0
        b = prom_sum(last, "cachefs_s3_bytes_total")
        b0 = prom_sum(first, "cachefs_s3_bytes_total") or 0
        def delta(name: str) -> float | None:
            v = prom_sum(last, name)
            return None if v is None else v - (prom_sum(first, name) or 0)

        issued, used = delta("cachefs_prefetch_issued_bytes_total"), delta("cachefs_prefetch_used_bytes_total")
        m["cachefs_metrics"] = {
            "s3_get_requests": None if g is None else g - g0,
            "s3_bytes": None if b is None else b - b0,
            "prefetch_issued_bytes": issued,
            "prefetch_used_bytes": used,
            # Readahead fetched from S3 that no read had used by the end of the run.
            "prefetch_unused_fraction": (
                (issued - used) / (b - b0) if (issued is not None and used is not None and b and b > b0) else None
            ),
            "raw_last": {k: v for k, v in last.items() if "bucket" not in k},
        }
    return m


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-run metrics plus cross-run ones (warm-up vs co-located, ratio, bound)."""
    ms = [run_metrics(r) for r in runs]
    by = {(m["dataset"], m["link"], m["system"]): m for m in ms}
    for m, run in zip(ms, runs, strict=True):
        ref = by.get((m["dataset"], "colocated", m["system"])) or by.get((m["dataset"], "local", m["system"]))
        ref_sps = ref["steady"]["samples_per_s"] if ref and ref.get("steady") else None
        m["reference_sps"] = ref_sps
        m["warmup_s"] = warmup_time(run["reader"], ref_sps) if ref_sps else None
        bw = run.get("link_params", {}).get("bandwidth_MBps") or 0
        m["warmup_bound_s"] = m["dataset_bytes"] / (bw * 1e6) if bw else None
        if m["link"] == "remote" and ref and ref.get("steady") and m.get("steady"):
            m["steady_ratio"] = m["steady"]["samples_per_s"] / ref["steady"]["samples_per_s"]
    return ms


# ---------------------------------------------------------------- outputs
STYLE = {
    "cachefs": "tab:blue",
    "cachefs-hint": "tab:purple",
    "rclone": "tab:orange",
    "s3fs": "tab:green",
    "local": "black",
}


def write_series(runs: list[dict[str, Any]], out_dir: Path) -> None:
    rows = []
    js: dict[str, Any] = {}
    for run in runs:
        r = run["reader"]
        key = f"{run['dataset']}/{run['link']}/{run['system']}"
        js[key] = {
            "epochs": [{"start": e["start"], "end": e["end"]} for e in r["epochs"]],
            "series": [{"t": s, "samples_per_s": n, "MBps": round(b / 1e6, 3)} for s, n, b in r["series"]],
        }
        for s, n, b in r["series"]:
            rows.append([run["dataset"], run["link"], run["system"], s, n, round(b / 1e6, 3)])
    (out_dir / "series.json").write_text(json.dumps(js))
    with open(out_dir / "series.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "link", "system", "second", "samples_per_s", "MBps"])
        w.writerows(rows)


PLOT_SMOOTH_S = 5  # DataLoader workers deliver whole batches in bursts: plot a moving average


def _smoothed(reader: dict[str, Any], idx: int) -> tuple[list[int], list[float]]:
    """Per-second values as a centred PLOT_SMOOTH_S moving average inside each epoch
    (gaps between epochs stay at their raw value). The raw series is in series.json."""
    spans = [(e["start"], e["end"]) for e in reader["epochs"]]
    s = reader["series"]

    def epoch_of(t: int) -> int:
        for i, (a, z) in enumerate(spans):
            if a <= t + 1 and t < z:
                return i
        return -1

    eps = [epoch_of(p[0]) for p in s]
    half = PLOT_SMOOTH_S // 2
    xs, ys = [], []
    for i, p in enumerate(s):
        w = [
            q[idx] for j, q in enumerate(s[max(0, i - half) : i + half + 1], start=max(0, i - half)) if eps[j] == eps[i]
        ]
        xs.append(p[0])
        ys.append(sum(w) / len(w) if eps[i] >= 0 else p[idx])
    return xs, ys


PEERS = ("rclone", "s3fs")
BAR_SYSTEMS = ("cachefs", "cachefs-hint", "rclone", "s3fs", "local")
#: A reference line or bar further above the data than this factor is drawn at the
#: top edge with its value written out, so it does not flatten everything else.
OFF_SCALE = 1.6


def _steady_sps(m: dict[str, Any] | None) -> float | None:
    return (m.get("steady") or {}).get("samples_per_s") if m else None


def _first_sps(m: dict[str, Any] | None) -> float | None:
    return m["epochs"][0]["samples_per_s"] if m and m.get("epochs") else None


def _reference_line(ax: Any, value: float | None, top: float, label: str, color: str) -> None:
    """A horizontal reference at ``value``, or, far above ``top``, a note at the top edge."""
    if not value:
        return
    if value <= top * OFF_SCALE:
        ax.axhline(value, color=color, ls=":", lw=1.3, label=f"{label} {value:,.0f}/s")
    else:
        ax.annotate(f"{label}: {value:,.0f}/s (off scale)", xy=(0.99, 0.97), xycoords="axes fraction",
                    ha="right", va="top", fontsize=7.5, color=color)


def plot(runs: list[dict[str, Any]], path: Path, title: str,
         ms: list[dict[str, Any]] | None = None) -> None:
    """The figure of RESULTS.md, one row per dataset, samples/s throughout:

    1. cachefs remote and co-located over time (5 s moving average), the remote run's
       first epoch (cold cache) shaded, the moment it comes within 5 % of co-located
       marked, the co-located steady state and the local disk as reference lines;
    2. the peers (rclone, s3fs) the same way on the same scale, with cachefs remote in grey;
    3. bars of first-epoch and steady throughput per system and link.

    ``ms`` are the run summaries (:func:`summarize`), computed when not given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ms = ms if ms is not None else summarize(runs)
    by_run = {(r["dataset"], r["link"], r["system"]): r for r in runs}
    by_m = {(m["dataset"], m["link"], m["system"]): m for m in ms}
    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(len(datasets), 3, figsize=(18, 4.3 * len(datasets)), squeeze=False,
                             gridspec_kw={"width_ratios": [1.3, 1.3, 1]})

    for row, ds in enumerate(datasets):
        ax_cf, ax_peers, ax_bar = axes[row]
        local = _steady_sps(by_m.get((ds, "local", "local")))

        def line(ax: Any, system: str, link: str, ds: str = ds, **kw: Any) -> list[float]:
            run = by_run.get((ds, link, system))
            if run is None:
                return []
            xs, ys = _smoothed(run["reader"], 1)
            # Between epochs the reader is restarting, not slow: break the line there.
            spans = [(e["start"], e["end"]) for e in run["reader"]["epochs"]]
            ys = [y if any(a <= x + 1 and x < z for a, z in spans) else float("nan")
                  for x, y in zip(xs, ys, strict=True)]
            kw.setdefault("color", STYLE.get(system))
            kw.setdefault("label", f"{system} {'co-located' if link == 'colocated' else link}")
            ax.plot(xs, ys, "-" if link == "remote" else "--", **kw)
            return [y for y in ys if y == y]  # without the gaps (NaN)

        # 1. cachefs: the story of the product.
        top = max(line(ax_cf, "cachefs", "remote", lw=2.0)
                  + line(ax_cf, "cachefs", "colocated", lw=1.4, alpha=0.8) + [1.0])
        remote = by_run.get((ds, "remote", "cachefs"))
        rm = by_m.get((ds, "remote", "cachefs"))
        if remote is not None:
            epochs = remote["reader"]["epochs"]
            ax_cf.axvspan(epochs[0]["start"], epochs[0]["end"], color="tab:blue", alpha=0.07,
                          label=f"remote epoch 1: cold cache ({epochs[0]['end'] - epochs[0]['start']:.0f} s)")
            for i, e in enumerate(epochs[1:], start=2):
                ax_cf.axvline(e["start"], color="grey", lw=0.6, alpha=0.5)
                ax_cf.annotate(f"epoch {i}", xy=(e["start"], 0.02), xycoords=("data", "axes fraction"),
                               fontsize=7, color="grey", rotation=90, ha="right", va="bottom")
            if rm and rm.get("warmup_s") is not None:
                ax_cf.axvline(rm["warmup_s"], color="tab:red", lw=1.2,
                              label=f"remote within 5% of co-located from {rm['warmup_s']:.0f} s")
            elif rm and rm.get("steady_ratio") is not None:
                ax_cf.plot([], [], " ", label=f"remote steady = {rm['steady_ratio']:.2f} x co-located")
        coloc = _steady_sps(by_m.get((ds, "colocated", "cachefs")))
        if coloc:
            ax_cf.axhline(coloc, color="tab:blue", ls=":", lw=1.0, alpha=0.7,
                          label=f"co-located steady {coloc:,.0f}/s")
        _reference_line(ax_cf, local, top, "local disk", "black")
        ax_cf.set_title(f"{ds}: cachefs, remote region vs co-located", fontsize=10)

        # 2. the peers, on the same scale.
        line(ax_peers, "cachefs", "remote", color="grey", lw=1.2, alpha=0.6,
             label="cachefs remote (for reference)")
        peer_top = [top]
        for system in PEERS:
            for link in ("remote", "colocated"):
                peer_top += line(ax_peers, system, link, lw=1.6 if link == "remote" else 1.2,
                                 alpha=1.0 if link == "remote" else 0.75)
        _reference_line(ax_peers, local, max(peer_top), "local disk", "black")
        ax_peers.set_title(f"{ds}: peers (rclone, s3fs), same scale", fontsize=10)
        ymax = max(peer_top) * 1.12
        if local and local <= max(peer_top) * OFF_SCALE:
            ymax = max(ymax, local * 1.08)
        for ax in (ax_cf, ax_peers):
            ax.set_ylim(0, ymax)
            ax.set_xlabel("seconds since the first epoch started")
            ax.set_ylabel("samples/s (5 s moving average)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7.5, loc="best")

        # 3. bars: first epoch and steady, per system and link.
        groups = [s for s in BAR_SYSTEMS if any(k[0] == ds and k[2] == s for k in by_m)]
        kinds = (("colocated", _first_sps), ("colocated", _steady_sps),
                 ("remote", _first_sps), ("remote", _steady_sps))
        width = 0.2
        bar_vals = [v for s in groups if s != "local" for link, f in kinds
                    if (v := f(by_m.get((ds, link, s)))) is not None]
        cap = max([*bar_vals, 1.0]) * 1.25
        for gi, system in enumerate(groups):
            for ki, (link, f) in enumerate(kinds):
                m = by_m.get((ds, "local" if system == "local" else link, system))
                if system == "local" and link == "remote":
                    continue
                v = f(m)
                if v is None or m is None:
                    continue
                x = gi + (ki - 1.5) * width if system != "local" else gi + (ki - 0.5) * width
                steady = f is _steady_sps
                ax_bar.bar(x, min(v, cap), width, color=STYLE.get(system, "grey"),
                           alpha=1.0 if steady else 0.4, hatch="//" if link == "colocated" and
                           system != "local" else None, edgecolor="white", lw=0.5)
                cut = f is _first_sps and not m.get("first_epoch_complete", True)
                text = f"{v:,.0f}" + ("*" if cut else "") + (" ↑" if v > cap else "")
                ax_bar.annotate(text, xy=(x, min(v, cap)), ha="center", va="bottom", fontsize=6.5,
                                rotation=90, xytext=(0, 2), textcoords="offset points")
        ax_bar.set_xticks(range(len(groups)))
        ax_bar.set_xticklabels(["local disk" if s == "local" else s for s in groups], fontsize=8)
        ax_bar.set_ylim(0, cap * 1.18)
        ax_bar.set_ylabel("samples/s")
        ax_bar.grid(alpha=0.3, axis="y")
        ax_bar.set_title(f"{ds}: first epoch and steady state", fontsize=10)
        ax_bar.legend(handles=[
            Patch(facecolor="grey", alpha=0.4, hatch="//", edgecolor="white", label="co-located, epoch 1"),
            Patch(facecolor="grey", hatch="//", edgecolor="white", label="co-located, steady"),
            Patch(facecolor="grey", alpha=0.4, label="remote, epoch 1"),
            Patch(facecolor="grey", label="remote, steady"),
        ], fontsize=7, loc="upper left", ncol=2)

    fig.suptitle(title + "\nsteady = epochs 2 and 3; * epoch cut at the time limit; "
                 "↑ bar clipped, value written", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def load_results(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, runs) from a results directory: summary.json plus the per-second
    series of series.json, as :func:`plot` takes them."""
    summary = json.loads((out_dir / "summary.json").read_text())
    runs = []
    for key, r in json.loads((out_dir / "series.json").read_text()).items():
        dataset, link, system = key.split("/")
        runs.append({"dataset": dataset, "link": link, "system": system, "reader": {
            "epochs": r["epochs"],
            "series": [(p["t"], p["samples_per_s"], p["MBps"] * 1e6) for p in r["series"]]}})
    return summary, runs


def plot_title(params: dict[str, Any]) -> str:
    return (f"{'quick' if params['quick'] else 'full'} run: remote = {params['rtt_ms']:g} ms RTT, "
            f"{params['bandwidth_MBps']:g} MB/s ({params['conn_bandwidth_MBps']:g}/conn); "
            f"co-located = {params['colocated_rtt_ms']:g} ms")


def _f(v: Any, fmt: str = "{:.1f}", none: str = "-") -> str:
    if v is None:
        return none
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def table(ms: list[dict[str, Any]]) -> str:
    head = (
        "| dataset | system | link | epoch 1 s | later epochs s | steady samples/s | steady MB/s | "
        "warm-up s (bound s) | remote/co-loc | epoch 1 link MB/s (util) | GETs | GET MB | unique MB | dup x | "
        "daemon CPU s | peak RSS MB | proxy CPU s |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    order = {"local": 0, "cachefs": 1, "cachefs-hint": 2, "rclone": 3, "s3fs": 4}
    for m in sorted(ms, key=lambda m: (m["dataset"], order.get(m["system"], 9), m["link"])):
        st = m.get("steady") or {}
        ep1 = _f(m["first_epoch_s"]) + ("" if m["first_epoch_complete"] else " (cut)")
        later = _f(m.get("later_epoch_s"))
        if any(e["truncated"] for e in m["epochs"][1:]):
            later += " (cut)"
        warm = "-"
        if m["link"] == "remote":
            warm = (_f(m.get("warmup_s"), "{:.0f}", "not reached")) + f" ({_f(m.get('warmup_bound_s'), '{:.0f}')})"
        util = "-"
        if m.get("first_epoch_link_MBps") is not None:
            util = _f(m["first_epoch_link_MBps"], "{:.0f}")
            if m.get("first_epoch_link_util") is not None:
                util += f" ({m['first_epoch_link_util'] * 100:.0f}%)"
        lines.append(
            "| "
            + " | ".join(
                [
                    m["dataset"],
                    m["system"],
                    m["link"],
                    ep1,
                    later,
                    _f(st.get("samples_per_s"), "{:.0f}"),
                    _f(st.get("MBps"), "{:.0f}"),
                    warm,
                    _f(m.get("steady_ratio"), "{:.2f}"),
                    util,
                    _f(m.get("get_count"), "{:d}"),
                    _f((m.get("get_bytes") or 0) / 1e6 if m.get("get_bytes") is not None else None, "{:.0f}"),
                    _f((m.get("unique_bytes") or 0) / 1e6 if m.get("unique_bytes") is not None else None, "{:.0f}"),
                    _f(m.get("duplication"), "{:.2f}"),
                    _f(m.get("daemon_cpu_s"), "{:.1f}"),
                    _f((m.get("daemon_peak_rss") or 0) / 2**20 if m.get("daemon_peak_rss") else None, "{:.0f}"),
                    _f(m.get("proxy_cpu_s"), "{:.1f}"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _pick(ms: list[dict[str, Any]], dataset: str, system: str, link: str) -> dict[str, Any] | None:
    return next((m for m in ms if (m["dataset"], m["system"], m["link"]) == (dataset, system, link)), None)


def targets(ms: list[dict[str, Any]]) -> str:
    """The fast-data-path targets, each with this run's value and whether it is met."""
    rows: list[list[str]] = []

    def row(target: str, where: str, value: float | None, fmt: str, ok: bool | None) -> None:
        verdict = "-" if ok is None else ("met" if ok else "**not met**")
        rows.append([target, where, "-" if value is None else fmt.format(value), verdict])

    for ds in ("shards", "images-inorder"):
        m = _pick(ms, ds, "cachefs", "remote")
        if m is None:
            continue
        u = m.get("first_epoch_link_util")
        row("first epoch moves >= 90% of the link", f"{ds}, remote", None if u is None else u * 100, "{:.0f}%",
            None if u is None else u >= 0.9)
    for ds in ("shards", "images-inorder", "images"):
        m = _pick(ms, ds, "cachefs", "remote")
        peers = [p for p in (_pick(ms, ds, s, "remote") for s in ("rclone", "s3fs")) if p and p.get("first_epoch_s")]
        if m is None or not peers or not m.get("first_epoch_s"):
            continue
        # A cut epoch's time is a lower bound: the ratio is then at least the value shown.
        best = min(peers, key=lambda p: p["first_epoch_s"])
        ratio = best["first_epoch_s"] / m["first_epoch_s"]
        row("first epoch >= 2x the better peer's throughput", f"{ds}, remote, vs {best['system']}", ratio,
            "{:.2f}x", ratio >= 2.0)
    for ds, key, need, what in (("shards", "MBps", 0.85, "MB/s"), ("images", "samples_per_s", 0.70, "files/s")):
        loc, m = _pick(ms, ds, "local", "local"), _pick(ms, ds, "cachefs", "remote")
        if not (loc and m and loc.get("steady") and m.get("steady")):
            continue
        ratio = m["steady"][key] / loc["steady"][key]
        row(f"warm epochs >= {need:.0%} of local disk {what}", f"{ds}, remote", ratio * 100, "{:.0f}%",
            ratio >= need)
    dups = [m["duplication"] for m in ms if m["system"].startswith("cachefs") and m.get("duplication")]
    if dups:
        row("GET bytes <= 1.02x unique bytes", "every cachefs run (worst)", max(dups), "{:.2f}x", max(dups) <= 1.02)
    for ds in ("shards", "images-inorder"):
        m = _pick(ms, ds, "cachefs", "remote")
        f = (m or {}).get("cachefs_metrics", {}).get("prefetch_unused_fraction")
        if m is not None and f is not None:
            row("readahead never used < 5% of fetched bytes", f"{ds}, remote", f * 100, "{:.1f}%", f < 0.05)
    rss = [m["daemon_peak_rss"] for m in ms if m["system"].startswith("cachefs") and m.get("daemon_peak_rss")]
    if rss:
        row("daemon memory bounded (block data <= --memory-budget, 512 MiB)", "peak RSS, every cachefs run",
            max(rss) / 2**20, "{:.0f} MB", None)
    head = "| target | measured on | value | |\n|---|---|---|---|\n"
    return head + "\n".join("| " + " | ".join(r) + " |" for r in rows)


NOTES_BEGIN = "<!-- notes: kept across runs -->"
NOTES_END = "<!-- /notes -->"


def render(summary: dict[str, Any], ms: list[dict[str, Any]], plot_path: str, keep_notes_from: str = "") -> str:
    """RESULTS.md: command, machine, parameters, self-check, table, plot.
    A hand-written block between the notes markers survives re-runs."""
    p = summary["params"]
    mach = summary["machine"]
    v = summary["versions"]
    sc = summary.get("selfcheck") or {}
    notes = ""
    if NOTES_BEGIN in keep_notes_from and NOTES_END in keep_notes_from:
        notes = keep_notes_from.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    L: list[str] = []
    L.append("# Benchmark results: remote region vs co-located, with peers\n")
    L.append(
        "Generated by `"
        + summary["command"].strip()
        + "` (started "
        + summary["started"]
        + f", took {summary['duration_s'] / 60:.1f} min).\n"
    )
    L.append(
        "Reproduce: `make bench` (full run) or `python -m benchmarks.run --quick` (seconds). "
        "Every parameter is a flag: `python -m benchmarks.run --help`.\n"
    )
    L.append("## Machine and software\n")
    L.append(
        f"- {mach['cpus']} cores ({mach['cpu_model']}), {mach['mem_gib']} GiB RAM, "
        f"kernel {mach['kernel']}, loopback only.\n"
        f"- Python {v['python']}, torch {v['torch']}, SeaweedFS `{v['weed']}`, `{v['rclone']}`, `{v['s3fs']}`.\n"
        "- All processes share the 2 cores: origin (weed), WAN emulator, the FUSE daemon and the DataLoader "
        "(main process + workers). Absolute numbers are therefore CPU-bound well below what each part does alone; "
        "compare systems with each other, not with hardware limits.\n"
    )
    L.append("## Parameters\n")
    L.append(
        f"- remote link: {p['rtt_ms']:g} ms RTT added per request (and one more RTT per new TCP connection), "
        f"{p['bandwidth_MBps']:g} MB/s total per direction, {p['conn_bandwidth_MBps']:g} MB/s per connection "
        f"(user-space emulator, kernel netem is not available here).\n"
        f"- co-located link: {p['colocated_rtt_ms']:g} ms RTT, "
        + (f"{p['colocated_bandwidth_MBps']:g} MB/s cap" if p["colocated_bandwidth_MBps"] else "no bandwidth cap")
        + " (same emulator, so GETs are counted the same way).\n"
        f"- datasets: images = {p['images']} files of ~{p['image_size'] / 1e3:.0f} KB in {p['classes']} class folders; "
        f"shards = {p['shards']} WebDataset tar shards of {p['shard_size_mb']} MiB.\n"
        f"- reader: PyTorch DataLoader, {p['workers']} workers, batch {p['batch_size']}, mode `{p['mode']}`"
        + (f" ({p['cpu_ms']:g} ms CPU per sample)" if p["mode"] == "cpu" else "")
        + f", {p['epochs']} epochs, reshuffled every epoch (`images-inorder`: directory order, no shuffle), "
        "page cache dropped before every epoch; "
        f"an epoch is cut after {p['epoch_timeout']:g} s (`(cut)` in the table).\n"
        f"- systems: {', '.join(p['systems'])}; every caching system starts with an empty cache "
        f"(cap {p['cache_size']}).\n"
    )
    if summary.get("skipped"):
        L.append("- skipped: " + "; ".join(f"{k}: {r}" for k, r in summary["skipped"].items()) + "\n")
    if sc:
        L.append("## Origin and link self-check (raw 8 MiB ranged GETs, no FUSE)\n")
        od = sc.get("origin_direct", {})
        L.append(f"- origin direct: **{od.get('MBps', 0):.0f} MB/s** ({od.get('conns')} connections, page cache warm).")
        if "origin_direct_cold" in sc:
            L.append(f"- origin direct, page cache just dropped: {sc['origin_direct_cold']['MBps']:.0f} MB/s.")
        for k in ("through_colocated", "through_remote"):
            if k in sc:
                r = sc[k]
                L.append(
                    f"- {k.replace('_', ' ')}: {r['MBps']:.0f} MB/s ({r['conns']} connections); emulator CPU "
                    f"{r['proxy_cpu_s']:.1f} s = {r['proxy_cpu_s_per_GB']:.2f} CPU s per GB relayed."
                )
        L.append("")
    L.append("## Results\n")
    L.append(
        "Columns: epoch times (s); steady = epochs after the first; warm-up = seconds from the start until "
        "throughput (centred 3 s moving average) stays within 5% of the same system's co-located steady state, next to "
        "its physical bound dataset bytes / link bandwidth; remote/co-loc = steady-state samples/s ratio; "
        "epoch 1 link = bytes the link carried during the first epoch per second (and % of the link cap); "
        "GETs / GET MB / unique MB / dup x = object GETs through the link, their body bytes, the union of the "
        "byte ranges fetched, and bytes/unique; daemon CPU and peak RSS of the FUSE daemon; proxy CPU = the "
        "emulator's own CPU seconds during the run.\n"
    )
    L.append(table(ms))
    L.append("")
    L.append("### Fast data path targets (this run)\n")
    L.append(targets(ms))
    L.append("")
    cf = [m for m in ms if m.get("cachefs_metrics")]
    if cf:
        L.append(
            'cachefs\'s own metrics (`cachefs_s3_requests_total{op="get"}`, `cachefs_s3_bytes_total`) over each run:\n'
        )
        for m in cf:
            c = m["cachefs_metrics"]
            L.append(
                f"- {m['dataset']} / {m['system']} / {m['link']}: "
                f"{c['s3_get_requests'] if c['s3_get_requests'] is not None else '-'} GETs, "
                f"{(c['s3_bytes'] or 0) / 1e6:.0f} MB (proxy saw {m.get('get_count')} GETs, "
                f"{(m.get('get_bytes') or 0) / 1e6:.0f} MB)"
            )
        L.append("")
    if summary.get("failures"):
        L.append("Failed runs:\n")
        for f in summary["failures"]:
            L.append(f"- {f['dataset']} / {f['system']} / {f['link']}: `{f['error'][-300:]}`")
        L.append("")
    L.append("### Throughput over time, first epoch and steady state\n")
    L.append(
        "One row per dataset, samples/s throughout. **Left:** cachefs over the remote link (solid) and "
        "co-located (dashed), 5 s moving average, lines broken between epochs; the shaded span is the remote "
        "run's first epoch (cold cache), the red line the moment the remote run stays within 5% of co-located "
        "(when it does, else the legend gives the steady-state ratio), the dotted lines the co-located steady "
        "state and the local disk (written at the top edge when it is far off scale). **Middle:** the peers, "
        "rclone and s3fs, drawn the same way on the same scale, with cachefs remote in grey for reference. "
        "**Right:** first-epoch (light) and steady (dark, epochs 2 and 3) throughput per system and link, "
        "co-located hatched; `*` marks an epoch cut at the time limit, `↑` a bar clipped to keep the others "
        "readable. Redraw it from the saved results with `python -m benchmarks.report`.\n"
    )
    L.append(f"![throughput over time]({plot_path})\n")
    L.append(
        "Raw series (one point per second, all systems and links): `series.json`, `series.csv`; "
        "all metrics: `summary.json` (next to the plot).\n"
    )
    L.append("## Notes\n")
    L.append(NOTES_BEGIN)
    L.append(notes or "(none yet)")
    L.append(NOTES_END)
    L.append("")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    """Redraw the figure and rewrite RESULTS.md from saved results, without running anything."""
    import argparse
    import os

    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    parser.add_argument("--results", type=Path, default=here / "results",
                        help="directory with summary.json and series.json (default: %(default)s)")
    parser.add_argument("--results-md", type=Path, default=here / "RESULTS.md",
                        help="RESULTS.md to rewrite; its notes block is kept (default: %(default)s)")
    args = parser.parse_args(argv)
    summary, runs = load_results(args.results)
    png = args.results / "throughput.png"
    plot(runs, png, plot_title(summary["params"]), summary["runs"])
    old = args.results_md.read_text() if args.results_md.exists() else ""
    rel = os.path.relpath(png, args.results_md.parent)
    args.results_md.write_text(render(summary, summary["runs"], rel, keep_notes_from=old))
    print(f"wrote {png} and {args.results_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
