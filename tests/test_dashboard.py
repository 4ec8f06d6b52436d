"""The Grafana dashboard only queries metrics and labels that cachefs exports.

Every PromQL expression is parsed with a real PromQL parser (promql-parser); the
metric names and label names it selects or groups by are checked against the
series cachefs.metrics exposes, taken from the registry itself so the two
cannot drift apart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

promql_parser = pytest.importorskip(
    "promql_parser", reason="promql-parser not installed (pip install promql-parser)")

from prometheus_client.metrics import MetricWrapperBase  # noqa: E402

from cachefs import metrics  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "cachefs-dashboard.json"
#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"instance", "job"}
#: Grafana's interval variables, replaced by a duration before parsing.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")


def exported_series() -> dict[str, set[str]]:
    """Every series name /metrics can expose -> the label names it carries."""
    declared: dict[str, set[str]] = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            # Labelled metrics expose no sample until a label value is first used, so
            # their label names come from the declaration.
            declared[obj._name] = set(obj._labelnames)
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
                "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created")}
    series: dict[str, set[str]] = {}
    for family in metrics.EXPOSED.collect():
        labels = declared.get(family.name, set())
        for suffix in suffixes.get(family.type, ("",)):
            series.setdefault(family.name + suffix, set()).update(labels)
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    for name in series:
        if name.endswith("_bucket"):
            series[name].add("le")
    return series


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target


def parse(expr: str) -> Any:
    return promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr))


def walk(node: Any) -> Iterator[Any]:
    yield node
    for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
        child = getattr(node, attr, None)
        for item in child if isinstance(child, list) else [child]:
            if item is not None:
                yield from walk(item)


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) of every series selector in the expression."""
    return [(node.name, {m.name: m.value for m in node.matchers.matchers})
            for node in walk(parse(expr)) if type(node).__name__ == "VectorSelector"]


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for node in walk(parse(expr)):
        modifier = getattr(node, "modifier", None)
        if type(node).__name__ == "AggregateExpr" and modifier is not None:
            labels.update(modifier.labels)
        if type(node).__name__ == "BinaryExpr" and modifier is not None:
            if modifier.matching is not None:
                labels.update(modifier.matching.labels)
            labels.update(modifier.group_labels or [])
    return labels


def all_exprs() -> list[tuple[str, str]]:
    exprs = [(title, t["expr"]) for title, t in targets(load_dashboard())]
    assert len(exprs) >= 30
    return exprs


def test_exported_series_include_counters_histograms_and_process_metrics() -> None:
    # Guards the name derivation the other tests rely on.
    series = exported_series()
    assert series["cachefs_s3_errors_total"] == {"op", "kind"}
    assert series["cachefs_fuse_request_duration_seconds_bucket"] == {"op", "le"}
    assert "cachefs_build_info" in series and "cachefs_cache_used_bytes" in series
    assert "process_resident_memory_bytes" in series
    assert "cachefs_s3_errors" not in series


@pytest.mark.parametrize(("title", "expr"), all_exprs())
def test_expression_selects_only_exported_metrics_and_labels(title: str, expr: str) -> None:
    series = exported_series()
    found = selectors(expr)  # raises ValueError when the expression does not parse
    assert found, f"{title}: no metric selected"
    allowed_labels: set[str] = set()
    for name, matchers in found:
        assert name in series, f"{title}: {name} is not exported by cachefs.metrics"
        labels = series[name] | TARGET_LABELS
        assert set(matchers) <= labels, f"{title}: {name} has no label {set(matchers) - labels}"
        # Every selector honours the dashboard's instance variable.
        assert matchers.get("instance") == "$instance", f"{title}: {name} ignores $instance"
        allowed_labels |= labels
    assert grouping_labels(expr) <= allowed_labels, title


def test_legends_only_use_labels_the_query_keeps() -> None:
    for title, target in targets(load_dashboard()):
        legend_labels = set(re.findall(r"{{\s*(\w+)\s*}}", target.get("legendFormat", "")))
        kept = grouping_labels(target["expr"])
        assert legend_labels <= kept, f"{title}: legend uses {legend_labels - kept}"


def test_bad_expressions_are_caught() -> None:
    # The checks above would pass vacuously if the parser accepted anything.
    with pytest.raises(ValueError):
        parse('sum(rate(cachefs_read_bytes_total{instance=~"$instance"}[$__rate_interval])')
    assert selectors("rate(cachefs_read_bytes[5m])")[0][0] not in exported_series()


def test_dashboard_variables_and_datasource() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query" and instance["multi"] and instance["includeAll"]
    match = re.fullmatch(r"label_values\((\w+), instance\)", instance["definition"])
    assert match and match.group(1) in exported_series()
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
        assert panel.get("description"), f"{panel['title']}: on-call needs a description"


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    dashboard = load_dashboard()
    all_panels = list(panels(dashboard))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_on_call_panels_exist_and_are_documented() -> None:
    titles = {p["title"] for p in panels(load_dashboard()) if p["type"] != "row"}
    required = {
        "Read throughput by source", "Byte hit ratio", "FUSE read latency",
        "S3 latency by operation", "S3 errors, throttles and retries", "Cache used vs capacity",
        "Evictions, rejections and corrupt blocks", "In-flight bytes vs memory budget",
        "Prefetch issued, used and wasted", "Warm-up progress",
    }
    assert required <= titles
    readme = (REPO / "deploy" / "README.md").read_text()
    undocumented = {t for t in titles if f"**{t}**" not in readme}
    assert not undocumented, f"panels missing from deploy/README.md: {sorted(undocumented)}"


def test_known_label_sets_cover_the_code_and_are_created() -> None:
    # The series created at daemon start (metrics.create_known_series) must name the
    # operations the code really uses, or the dashboard's error panels stay empty.
    source = "\n".join(p.read_text() for p in (REPO / "cachefs").rglob("*.py"))
    from cachefs.fuse.server import SPECIAL_OPS
    from cachefs.fuse_ops import OP_NAMES

    fuse_ops = set(OP_NAMES.values()) | set(SPECIAL_OPS.values()) | {"other"}
    s3_ops = set(re.findall(r'\b_(?:call|retry)\(\s*"(\w+)"', source)
                 + re.findall(r'\bS3_[A-Z]+\.labels\(\s*"(\w+)"', source))
    assert fuse_ops and s3_ops
    assert fuse_ops == set(metrics.FUSE_OPS)
    assert s3_ops == set(metrics.S3_OPS)
    from cachefs.read.prefetcher import POLICIES

    assert set(POLICIES) == set(metrics.PREFETCH_POLICIES)
    metrics.create_known_series()
    samples = {(s.name, tuple(sorted(s.labels.items())))
               for family in metrics.REGISTRY.collect() for s in family.samples}
    for op in metrics.S3_OPS:
        assert ("cachefs_s3_errors_total", (("kind", metrics.S3_ALERT_KIND), ("op", op))) in samples
        assert ("cachefs_s3_throttles_total", (("op", op),)) in samples
        for reason in metrics.S3_RETRY_REASONS:
            assert ("cachefs_s3_retries_total", (("op", op), ("reason", reason))) in samples
        assert ("cachefs_s3_deadline_exceeded_total", (("op", op),)) in samples
    from cachefs.s3.integrity import CHECKS

    assert set(metrics.S3_CHECKS) == {*CHECKS, "etag_md5"}
    for check in metrics.S3_CHECKS:
        assert ("cachefs_s3_integrity_errors_total", (("check", check),)) in samples
    for op in metrics.FUSE_OPS:
        assert ("cachefs_fuse_errors_total", (("errno", "EIO"), ("op", op))) in samples
    for reason in metrics.SKIP_REASONS:
        assert ("cachefs_skipped_keys_total", (("reason", reason),)) in samples
    for policy in metrics.PREFETCH_POLICIES:
        assert ("cachefs_prefetch_wasted_bytes_total", (("policy", policy),)) in samples


#: Shared-tier families the dashboard need not query, and why.
SHARED_NOT_ON_DASHBOARD = {
    "cachefs_shared_enabled": "1 on every mount with a tier: the row itself shows whether",
    "cachefs_shared_publish_queue_blocks": "the same queue is shown in bytes, with its bound",
}


def test_every_shared_tier_metric_is_on_the_dashboard() -> None:
    """The shared tier's row shows every family the tier exports (an on-call looking at a
    tier that flaps or is hammered with lease writes had no panel for either)."""
    used = {name for _, expr in all_exprs() for name, _ in selectors(expr)}
    families = {obj._name for obj in vars(metrics).values()
                if isinstance(obj, MetricWrapperBase) and obj._name.startswith("cachefs_shared")}
    assert len(families) >= 12
    missing = {family for family in families - set(SHARED_NOT_ON_DASHBOARD)
               if not any(family + suffix in used
                          for suffix in ("", "_total", "_bucket", "_count", "_sum"))}
    assert not missing, f"shared-tier metrics not on the dashboard: {sorted(missing)}"
