"""Deterministic benchmark datasets, generated locally and uploaded once.

Two shapes, both made of incompressible bytes (like JPEG payloads):

* ``images``: ``count`` files of ~``mean_size`` bytes (uniform +-40%) spread
  over ``classes`` class folders: ``train/c007/img000123.jpg`` (ImageNet-like).
* ``shards``: ``count`` WebDataset-style tar shards of ~``shard_size`` bytes,
  each holding ``NNNNNNNN.jpg`` (~mean_size) + ``NNNNNNNN.cls`` samples:
  ``shards/train-00003.tar``.

Each dataset has an id derived from its parameters; it lives under
``<workdir>/data/<id>/`` on local disk (that copy is also the "local" system)
and under ``s3://<bucket>/<id>/`` on the origin. A manifest (paths and sizes,
plus a digest) is stored at ``s3://<bucket>/_manifests/<id>.json``: when the
origin already holds the identical manifest the upload is skipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MANIFEST_PREFIX = "_manifests"


@dataclass(frozen=True)
class DatasetSpec:
    kind: str  # "images" | "shards"
    count: int  # files (images) or shards (shards)
    mean_size: int = 110_000  # bytes per image / per sample
    classes: int = 100  # class folders (images) / label range (shards)
    shard_size: int = 256 << 20  # bytes per shard (shards)
    seed: int = 0

    @property
    def id(self) -> str:
        if self.kind == "images":
            return f"images-n{self.count}-c{self.classes}-s{self.mean_size}-seed{self.seed}"
        return f"shards-n{self.count}-b{self.shard_size}-s{self.mean_size}-seed{self.seed}"


@dataclass
class Dataset:
    spec: DatasetSpec
    local_root: Path  # local copy (files relative to here)
    prefix: str  # S3 key prefix (no trailing slash)
    files: list[tuple[str, int]]  # (relative path, size)
    digest: str
    samples_per_file: list[int]  # images: 1 each; shards: samples in each shard

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)

    @property
    def total_samples(self) -> int:
        return sum(self.samples_per_file)

    def manifest(self) -> dict[str, Any]:
        return {
            "id": self.spec.id,
            "spec": asdict(self.spec),
            "prefix": self.prefix,
            "digest": self.digest,
            "total_bytes": self.total_bytes,
            "total_samples": self.total_samples,
            "files": [[p, s, n] for (p, s), n in zip(self.files, self.samples_per_file, strict=True)],
        }


def _image_sizes(spec: DatasetSpec) -> list[int]:
    rng = random.Random(f"sizes-{spec.seed}-{spec.mean_size}")
    return [int(spec.mean_size * rng.uniform(0.6, 1.4)) for _ in range(spec.count)]


def _payload(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def _image_paths(spec: DatasetSpec) -> list[str]:
    return [f"train/c{i % spec.classes:03d}/img{i:06d}.jpg" for i in range(spec.count)]


def _write_shard(path: Path, spec: DatasetSpec, shard: int) -> int:
    """Write one tar shard; returns the number of samples."""
    rng = random.Random(f"shard-{spec.seed}-{shard}")
    tmp = path.with_suffix(".tmp")
    n = 0
    with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        while f.tell() < spec.shard_size - spec.mean_size:
            key = f"{shard:05d}{n:06d}"
            size = int(spec.mean_size * rng.uniform(0.6, 1.4))
            for name, body in (
                (f"{key}.jpg", _payload(f"{spec.seed}-{key}", size)),
                (f"{key}.cls", b"%d" % rng.randrange(spec.classes)),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                info.mtime = 1_700_000_000
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(body))
            n += 1
    os.replace(tmp, path)
    return n


def generate(spec: DatasetSpec, workdir: Path, threads: int = 2, log=print) -> Dataset:
    """Create the local copy (idempotent: reused when complete)."""
    root = workdir / "data" / spec.id
    marker = root / ".complete.json"
    if marker.exists():
        m = json.loads(marker.read_text())
        files = [(p, s) for p, s, _ in m["files"]]
        return Dataset(spec, root, spec.id, files, m["digest"], [n for _, _, n in m["files"]])
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if spec.kind == "images":
        paths = _image_paths(spec)
        sizes = _image_sizes(spec)
        for c in range(min(spec.classes, spec.count)):
            (root / f"train/c{c:03d}").mkdir(parents=True, exist_ok=True)

        def write(i: int) -> None:
            (root / paths[i]).write_bytes(_payload(f"{spec.seed}-{paths[i]}", sizes[i]))

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(write, range(spec.count)))
        files = list(zip(paths, sizes, strict=True))
        samples = [1] * spec.count
    elif spec.kind == "shards":
        (root / "shards").mkdir(parents=True, exist_ok=True)
        names = [f"shards/train-{j:05d}.tar" for j in range(spec.count)]
        with ThreadPoolExecutor(threads) as ex:
            samples = list(ex.map(lambda j: _write_shard(root / names[j], spec, j), range(spec.count)))
        files = [(p, (root / p).stat().st_size) for p in names]
    else:
        raise ValueError(f"unknown dataset kind {spec.kind!r}")
    digest = hashlib.sha256(json.dumps([files, samples]).encode()).hexdigest()[:16]
    ds = Dataset(spec, root, spec.id, files, digest, samples)
    marker.write_text(json.dumps(ds.manifest()))
    log(f"generated {spec.id}: {len(files)} files, {ds.total_bytes / 1e6:.0f} MB in {time.monotonic() - t0:.1f}s")
    return ds


def upload(ds: Dataset, s3: Any, bucket: str, threads: int = 16, log=print) -> bool:
    """Upload unless the origin holds the same manifest. Returns True if uploaded."""
    mkey = f"{MANIFEST_PREFIX}/{ds.spec.id}.json"
    try:
        remote = json.loads(s3.get_object(Bucket=bucket, Key=mkey)["Body"].read())
        if remote.get("digest") == ds.digest and remote.get("total_bytes") == ds.total_bytes:
            return False
    except s3.exceptions.NoSuchKey:
        pass
    except Exception as e:
        if "NoSuchKey" not in str(e) and "404" not in str(e):
            raise
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
    t0 = time.monotonic()

    def put(item: tuple[str, int]) -> None:
        rel, size = item
        key = f"{ds.prefix}/{rel}"
        if size >= cfg.multipart_threshold:
            s3.upload_file(str(ds.local_root / rel), bucket, key, Config=cfg)
        else:
            s3.put_object(Bucket=bucket, Key=key, Body=(ds.local_root / rel).read_bytes())

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(put, ds.files))
    s3.put_object(Bucket=bucket, Key=mkey, Body=json.dumps(ds.manifest()).encode())
    dt = time.monotonic() - t0
    log(f"uploaded {ds.spec.id}: {ds.total_bytes / 1e6:.0f} MB in {dt:.1f}s ({ds.total_bytes / dt / 1e6:.0f} MB/s)")
    return True


def verify_sample(ds: Dataset, s3: Any, bucket: str, n: int = 3) -> None:
    """Spot-check that a few objects on the origin equal the local files."""
    rng = random.Random(0)
    for rel, _size in rng.sample(ds.files, min(n, len(ds.files))):
        body = s3.get_object(Bucket=bucket, Key=f"{ds.prefix}/{rel}", Range="bytes=0-4095")["Body"].read()
        with open(ds.local_root / rel, "rb") as f:
            if f.read(4096) != body:
                raise RuntimeError(f"origin object {rel} differs from the local copy")
