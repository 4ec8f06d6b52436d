"""The training-read workload: a PyTorch DataLoader over a directory.

Run as a subprocess per (system, link, dataset)::

    python -m benchmarks.reader --root MOUNT --manifest M.json --out R.json \\
        [--epochs 3] [--workers 4] [--batch-size 32] [--mode io|cpu] [--cpu-ms 2]

* images (map-style): one sample per file, ``RandomSampler`` reshuffled every
  epoch (seed + epoch), each worker ``open().read()``s whole files.
* shards (iterable): shard order reshuffled every epoch and split across the
  workers; each worker streams its tars sequentially (WebDataset style) through
  a small shuffle buffer; one sample = one ``.jpg`` + ``.cls`` pair.
* ``--order directory`` replaces the shuffles with the sorted path order (files
  in directory order, shards in name order): the walk a directory-order
  preprocessing job or an unshuffled loader does.
* ``--mode io`` only reads bytes; ``--mode cpu`` adds a fixed CPU cost per
  sample (``--cpu-ms`` of thread CPU time spinning), standing in for decode.
* The page cache is dropped before every epoch (root), so epochs after the
  first measure the system's own cache, not RAM.
* Output: per-second samples and bytes over the whole run (one point per
  second since the first epoch started), per-epoch times, and snapshots of
  the given stats endpoints / daemon process at each epoch boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.util import drop_caches

TAR_BLOCK = 512
HINTS: list[Any] = []  # hinted samplers / hints sent (--hint)


def spin(cpu_ms: float) -> None:
    """Burn ``cpu_ms`` of this thread's CPU time (fixed per-sample cost)."""
    if cpu_ms <= 0:
        return
    end = time.thread_time() + cpu_ms / 1000.0
    x = 0
    while time.thread_time() < end:
        for i in range(200):
            x += i * i


def read_file(path: str) -> int:
    with open(path, "rb", buffering=0) as f:
        n = 0
        while True:
            b = f.read(1 << 20)
            if not b:
                return n
            n += len(b)


def iter_tar(path: str):
    """Minimal streaming ustar reader: yields (name, payload_len, bytes_consumed)."""
    with open(path, "rb", buffering=1 << 20) as f:
        while True:
            hdr = f.read(TAR_BLOCK)
            if len(hdr) < TAR_BLOCK or hdr == b"\0" * TAR_BLOCK:
                # end of archive: consume the rest (zero blocks / padding)
                rest = 0
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    rest += len(b)
                yield None, 0, len(hdr) + rest
                return
            name = hdr[:100].split(b"\0", 1)[0].decode()
            prefix = hdr[345:500].split(b"\0", 1)[0].decode()
            if prefix:
                name = prefix + "/" + name
            size = int(hdr[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
            padded = (size + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK
            data = f.read(padded)
            if len(data) < padded:
                raise OSError(f"truncated tar member {name} in {path}")
            yield name, size, TAR_BLOCK + padded


# ---------------------------------------------------------------- datasets
def build_loader(kind: str, root: Path, files: list[list[Any]], epoch: int, args: argparse.Namespace):
    import torch
    from torch.utils.data import (
        DataLoader,
        Dataset,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
        get_worker_info,
    )

    cpu_ms = args.cpu_ms if args.mode == "cpu" else 0.0

    def collate(batch: list[tuple[int, int]]) -> tuple[int, int]:
        return len(batch), sum(b for _, b in batch)

    if kind == "images":

        class Files(Dataset):
            def __init__(self) -> None:
                self.paths = sorted(str(root / p) for p, _, _ in files)

            def __len__(self) -> int:
                return len(self.paths)

            def __getitem__(self, i: int) -> tuple[int, int]:
                n = read_file(self.paths[i])
                spin(cpu_ms)
                return 1, n

        g = torch.Generator()
        g.manual_seed(args.seed * 1000 + epoch)
        ds = Files()
        sampler: Any = RandomSampler(ds, generator=g) if args.order == "shuffled" else SequentialSampler(ds)
        if args.hint:
            # cachefs's read-order hint: the daemon prefetches in sampler order
            from cachefs.torch import hinted

            sampler = hinted(sampler, paths=ds.paths)
            HINTS.append(sampler)
        return DataLoader(
            ds,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            collate_fn=collate,
            prefetch_factor=args.prefetch_factor if args.workers else None,
        )

    class Shards(IterableDataset):
        def __init__(self) -> None:
            order = sorted(str(root / p) for p, _, _ in files)
            if args.order == "shuffled":
                random.Random(args.seed * 1000 + epoch).shuffle(order)
            self.order = order

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            rng = random.Random(args.seed * 1000 + epoch * 100 + wid)
            buf: list[tuple[int, int]] = []
            pending = 0  # tar bytes consumed not yet attributed to a sample
            for path in self.order[wid::nw]:
                have_jpg = False
                for name, _size, consumed in iter_tar(path):
                    pending += consumed
                    if name is None:
                        continue
                    if name.endswith(".jpg"):
                        have_jpg = True
                    elif name.endswith(".cls") and have_jpg:
                        spin(cpu_ms)
                        buf.append((1, pending))
                        pending = 0
                        have_jpg = False
                        if len(buf) >= args.shuffle_buffer:
                            yield buf.pop(rng.randrange(len(buf)))
                # trailing bytes of this shard (end-of-archive blocks) count too
                if pending and buf:
                    s, b = buf[-1]
                    buf[-1] = (s, b + pending)
                    pending = 0
            rng.shuffle(buf)
            yield from buf
            if pending:
                yield 0, pending

    shards = Shards()
    if args.hint:
        # the shard order of this epoch (workers take every n-th shard of it)
        from cachefs.control.client import send_hint

        try:
            send_hint(shards.order)
            HINTS.append("sent")
        except Exception as e:
            print(f"  hint not sent: {e}", flush=True)
    return DataLoader(
        shards,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=collate,
        prefetch_factor=args.prefetch_factor if args.workers else None,
    )


# ---------------------------------------------------------------- snapshots
def snapshot(args: argparse.Namespace) -> dict[str, Any]:
    snap: dict[str, Any] = {"t": time.time()}
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
        snap["machine_cpu"] = {"busy": sum(cpu) - cpu[3] - cpu[4], "total": sum(cpu)}  # jiffies
    for url in args.stats_url:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = r.read().decode()
            snap[url] = json.loads(body) if url.endswith("/stats") else body
        except Exception as e:
            snap[url] = {"error": repr(e)}
    for pid in args.pid:
        from benchmarks.util import proc_sample

        s = proc_sample(pid)
        snap[f"pid:{pid}"] = None if s is None else {"cpu_s": s.cpu_s, "rss": s.rss_bytes, "peak_rss": s.peak_rss_bytes}
    return snap



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DataLoader read benchmark")
    p.add_argument("--root", required=True, type=Path)
    p.add_argument("--manifest", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--shuffle-buffer", type=int, default=64)
    p.add_argument("--mode", choices=("io", "cpu"), default="io")
    p.add_argument("--order", choices=("shuffled", "directory"), default="shuffled",
                   help="sample order: reshuffled every epoch, or sorted paths (directory order)")
    p.add_argument("--cpu-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-timeout", type=float, default=0.0, help="stop an epoch after this many seconds (0 = never)")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=0.0,
        help="start no epoch, and cut the current one, after this many seconds of the run",
    )
    p.add_argument("--hint", action="store_true", help="send cachefs the read order every epoch (cachefs.torch.hinted)")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--stats-url", action="append", default=[], help="snapshot this URL at every epoch boundary")
    p.add_argument("--pid", action="append", type=int, default=[], help="snapshot CPU/RSS of this pid at boundaries")
    args = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    manifest = json.loads(args.manifest.read_text())
    kind = manifest["spec"]["kind"]
    files = manifest["files"]
    expected_bytes = sum(s for _, s, _ in files)
    expected_samples = sum(n for _, _, n in files)

    # Listing through the mount, timed once (outside the epochs).
    t = time.monotonic()
    listed = 0
    for _dirpath, _dirs, names in os.walk(args.root):
        listed += len(names)
    list_s = time.monotonic() - t

    per_sec: dict[int, list[float]] = {}
    epochs: list[dict[str, Any]] = []
    snaps: list[dict[str, Any]] = []
    t0: float | None = None
    for epoch in range(args.epochs):
        if args.run_timeout and t0 is not None and time.time() - t0 > args.run_timeout:
            print(f"  run timeout ({args.run_timeout:g}s): epochs {epoch}.. not run", flush=True)
            break
        dropped = False if args.no_drop_caches else drop_caches()
        snaps.append(snapshot(args))
        HINTS.clear()
        loader = build_loader(kind, args.root, files, epoch, args)
        start = time.time()
        if t0 is None:
            t0 = start
        samples = nbytes = 0
        truncated = False
        it = iter(loader)
        first_batch_s = None
        try:
            for n, b in it:
                now = time.time()
                if first_batch_s is None:
                    first_batch_s = now - start
                samples += n
                nbytes += b
                row = per_sec.setdefault(int(now - t0), [0, 0])
                row[0] += n
                row[1] += b
                if (args.epoch_timeout and now - start > args.epoch_timeout) or (
                    args.run_timeout and now - t0 > args.run_timeout
                ):
                    truncated = True
                    break
        finally:
            del it
        end = time.time()
        snaps.append(snapshot(args))
        epochs.append(
            {
                "epoch": epoch,
                "start": start - t0,
                "end": end - t0,
                "seconds": end - start,
                "samples": samples,
                "bytes": nbytes,
                "truncated": truncated,
                "complete": (not truncated) and samples == expected_samples and nbytes == expected_bytes,
                "first_batch_s": first_batch_s,
                "page_cache_dropped": dropped,
                "hints_sent": sum(getattr(h, "hints_sent", 1) for h in HINTS) if args.hint else None,
            }
        )
        print(
            f"  epoch {epoch}: {end - start:7.1f}s {samples / (end - start):8.0f} samples/s "
            f"{nbytes / (end - start) / 1e6:7.1f} MB/s{' (truncated)' if truncated else ''}",
            flush=True,
        )

    last = max(per_sec) if per_sec else -1
    series = [[s, per_sec.get(s, [0, 0])[0], per_sec.get(s, [0, 0])[1]] for s in range(last + 1)]
    out = {
        "kind": kind,
        "root": str(args.root),
        "t0": t0,
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "expected_bytes": expected_bytes,
        "expected_samples": expected_samples,
        "listed_files": listed,
        "list_seconds": list_s,
        "epochs": epochs,
        "series": series,  # [second since t0, samples, bytes]
        "snapshots": snaps,
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
