"""deploy/kubernetes: schema validation offline, plus the checks schemas cannot make.

Built-in kinds are validated strictly (unknown fields rejected) against the
Kubernetes JSON schemas bundled in the kubernetes-validate package; PodMonitor
is a CRD, so it only gets the structural checks below.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
CONFIG_KEYS = {
    "source", "mountpoint", "cache_dir", "cache_size", "endpoint_url", "region",
    "metrics_addr", "metadata_ttl", "cache_policy", "allow_other", "uid", "gid", "file_mode",
    "dir_mode", "log_level", "memory_budget", "block_size", "shared_cache",
    "shared_cache_endpoint_url", "shared_cache_region", "shared_cache_profile",
    "shared_cache_timeout",
}
UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def one(kind: str, file: str | None = None) -> dict[str, Any]:
    found = [d for f, d in documents() if d["kind"] == kind and file in (None, f)]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def config() -> dict[str, Any]:
    return tomllib.loads(one("ConfigMap")["data"]["cachefs.toml"])


def size_bytes(text: str) -> int:
    """'2G' (cachefs) or '3Gi' (Kubernetes) -> bytes."""
    number, unit = text.rstrip("i")[:-1], text.rstrip("i")[-1]
    return int(float(number) * UNITS[unit])


def is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def test_every_document_parses_and_has_identity() -> None:
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "PodMonitor", "Pod",
            "Kustomization"} <= kinds
    for name, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), name
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], name


@pytest.mark.parametrize(("name", "doc"), [
    (name, doc) for name, doc in documents()
    if doc["kind"] not in ("PodMonitor", "Kustomization")])
def test_builtin_kinds_validate_against_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed")
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_rejects_mistakes() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed")
    daemonset = one("DaemonSet")
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    broken = {**daemonset, "spec": {**daemonset["spec"], "template": {
        **daemonset["spec"]["template"], "spec": {
            **daemonset["spec"]["template"]["spec"],
            "containers": [{**container, "mountPropagaton": "Bidirectional"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_deployment_manifest() -> None:
    kustomization = one("Kustomization")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml",
                                                      "example-training-pod.yaml",
                                                      "warm-shard-job.yaml"}
    assert listed == on_disk
    namespace = one("Namespace")["metadata"]["name"]
    assert kustomization["namespace"] == namespace
    for name, doc in documents():
        if doc["kind"] not in ("Namespace", "Kustomization", "Pod"):
            assert doc["metadata"]["namespace"] == namespace, name
    images = {c["image"].split(":")[0] for c in pod_spec()["containers"] + pod_spec()[
        "initContainers"]}
    assert images <= {i["name"] for i in kustomization["images"]}


def pod_spec() -> dict[str, Any]:
    return one("DaemonSet")["spec"]["template"]["spec"]


def test_daemonset_wiring() -> None:
    daemonset = one("DaemonSet")
    spec = pod_spec()
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= (
        daemonset["spec"]["template"]["metadata"]["labels"].items())
    assert spec["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in spec["containers"] + spec["initContainers"]:
        assert container["image"] and container["command"], container["name"]
        assert container["securityContext"]["privileged"] is True
        for mount in container["volumeMounts"]:
            assert mount["name"] in volumes, f"{container['name']}: no volume {mount['name']}"
    assert volumes["dev-fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert volumes["config"]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]

    daemon = spec["containers"][0]
    assert daemon["command"] == [
        "cachefs", "mount", "--config", "/etc/cachefs/cachefs.toml", "--foreground"]
    assert daemon["readinessProbe"]["exec"]["command"][:3] == ["cachefs", "status", "--json"]
    assert daemon["lifecycle"]["preStop"]["exec"]["command"][:2] == ["cachefs", "unmount"]
    # The node's name, not the pod's: a replaced pod is the same node to the shared tier.
    env = {e["name"]: e for e in daemon["env"]}
    assert env["CACHEFS_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert not spec.get("hostNetwork")
    assert spec["terminationGracePeriodSeconds"] >= 30
    assert "cachefs unmount --config /etc/cachefs/cachefs.toml --lazy --quiet" in (
        spec["initContainers"][0]["command"][-1])


def test_config_matches_the_daemonset() -> None:
    cfg = config()
    assert set(cfg) <= CONFIG_KEYS
    daemon = pod_spec()["containers"][0]
    mounts = {m["mountPath"]: m for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    # The config file is where the command says, from the ConfigMap's key.
    config_mount = next(m for m in mounts.values() if m["name"] == "config")
    assert f"{config_mount['mountPath']}/cachefs.toml" == daemon["command"][3]
    # The mount point lies inside a Bidirectional hostPath mount, so the host sees it ...
    shared = [m for m in mounts.values() if m.get("mountPropagation") == "Bidirectional"]
    assert any(is_under(cfg["mountpoint"], m["mountPath"]) and m["mountPath"] != cfg[
        "mountpoint"] and "hostPath" in volumes[m["name"]] for m in shared)
    assert daemon["readinessProbe"]["exec"]["command"][-1] == cfg["mountpoint"]
    # ... and the cache on a hostPath, so it survives pod restarts.
    cache = [m for m in mounts.values() if is_under(cfg["cache_dir"], m["mountPath"])]
    assert cache and "hostPath" in volumes[cache[0]["name"]]
    # Metrics are served on the declared port, on an address the pod IP reaches.
    host, _, port = cfg["metrics_addr"].rpartition(":")
    assert host in ("0.0.0.0", "", "[::]")
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports["metrics"] == int(port)
    # Memory: request covers the fetch budget, the limit leaves headroom over it.
    budget = size_bytes(cfg["memory_budget"])
    resources = daemon["resources"]
    assert size_bytes(resources["requests"]["memory"]) >= budget
    assert size_bytes(resources["limits"]["memory"]) >= budget + 1024**3


def test_podmonitor_scrapes_the_daemon() -> None:
    monitor = one("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in pod_spec()["containers"][0]["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert endpoints and all(e["port"] in ports and e["path"] == "/metrics" for e in endpoints)


def test_example_pod_reads_the_host_mount() -> None:
    pod = one("Pod", "example-training-pod.yaml")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = pod["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPropagation"] == "HostToContainer" and mount["readOnly"] is True
    host_dir = volumes[mount["name"]]["hostPath"]["path"]
    bidirectional = {m["name"]: m["mountPath"] for m in pod_spec()["containers"][0][
        "volumeMounts"] if m.get("mountPropagation") == "Bidirectional"}
    daemon_volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    shared_host_dirs = {daemon_volumes[n]["hostPath"]["path"] for n in bidirectional}
    # The daemon sees the shared host directory at the same path, so its config's
    # mount point is also the host path.
    assert all(daemon_volumes[n]["hostPath"]["path"] == path for n, path in bidirectional.items())
    # The pod mounts the shared parent directory (not the mount point itself), so a
    # remount after a daemon restart reaches it.
    assert host_dir in shared_host_dirs
    assert config()["mountpoint"] != host_dir and is_under(config()["mountpoint"], host_dir)
    assert config()["mountpoint"] in pod["spec"]["containers"][0]["command"][-1]


def test_warm_shard_job_gives_each_node_its_shard() -> None:
    job = one("Job", "warm-shard-job.yaml")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    # One pod per shard, all at once, pod i warming shard i of N.
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["SHARDS"])
    assert '--shard "$JOB_COMPLETION_INDEX/$SHARDS"' in container["command"][-1]
    assert container["command"][-1].split()[1:4] == ["cachefs", "warm", config()["mountpoint"]]
    # ... on different nodes.
    term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= (
        spec["template"]["metadata"]["labels"].items())
    # It reaches its node's daemon: the same host runtime directory (control sockets) ...
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    daemon_mounts = {m["mountPath"]: m["name"] for m in pod_spec()["containers"][0][
        "volumeMounts"]}
    daemon_volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    assert volumes[mounts["/run/cachefs"]["name"]] == (
        daemon_volumes[daemon_mounts["/run/cachefs"]]["hostPath"]["path"])
    # ... and the mount through the shared host directory, as training pods do.
    host = mounts["/mnt/cachefs"]
    assert host["mountPropagation"] == "HostToContainer"
    assert volumes[host["name"]] == daemon_volumes[daemon_mounts["/mnt/cachefs"]][
        "hostPath"]["path"]
    assert container["securityContext"]["runAsUser"] == 0
