"""``cachefs probe``: measure the link to a bucket before moving a training job.

Measures, against real objects under the prefix: LIST latency, small-GET
latency (1-byte ranged GETs, p50/p90), single-stream throughput (sequential
8 MiB ranged GETs of the largest object) and parallel throughput (N streams of
ranged GETs spread over the objects), each for a bounded time. Results feed
``cachefs plan --probe FILE``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
import time
from typing import Any

from cachefs.config import parse_s3_url
from cachefs.errors import ConfigError, StoreError
from cachefs.s3.boto import S3Store
from cachefs.s3.store import ObjectInfo

PART = 8 << 20


def _objects(store: S3Store, prefix: str, want: int = 1000) -> tuple[list[ObjectInfo], float]:
    """Up to ``want`` non-empty objects under ``prefix`` (breadth-first) and the first
    LIST's latency."""
    found: list[ObjectInfo] = []
    queue = [prefix]
    first_latency = 0.0
    while queue and len(found) < want:
        p = queue.pop(0)
        t0 = time.perf_counter()
        page = store.list_page(p, None)
        if not first_latency:
            first_latency = time.perf_counter() - t0
        found.extend(o for o in page.objects if o.size > 0)
        queue.extend(page.prefixes[:50])
    return found, first_latency


#: Bounds of the probe's flags: streams (each a thread and a connection, as the mount's
#: --max-connections), latency samples (one GET after the other) and seconds per test.
PARALLEL_MAX = 1024
SAMPLES_MAX = 10_000
SECONDS_MAX = 3600


def probe(store: S3Store, prefix: str, *, samples: int, parallel: int,
          seconds: float) -> dict[str, Any]:
    objects, list_latency = _objects(store, prefix)
    if not objects:
        raise ConfigError(f"no objects under s3://{store.bucket}/{prefix} to measure with")
    smallest = min(objects, key=lambda o: o.size)
    largest = max(objects, key=lambda o: o.size)

    lat = []
    for _ in range(samples):
        t0 = time.perf_counter()
        store.get_range(smallest.key, smallest.etag, 0, 1)
        lat.append(time.perf_counter() - t0)
    lat.sort()

    def stream(obj_list: list[ObjectInfo], deadline: float, counter: list[int],
               lock: threading.Lock, start: int) -> None:
        i = start
        offset = 0
        while time.perf_counter() < deadline:
            obj = obj_list[i % len(obj_list)]
            end = min(obj.size, offset + PART)
            data = store.get_range(obj.key, obj.etag, offset, end)
            with lock:
                counter[0] += len(data)
            offset = end
            if offset >= obj.size:
                offset = 0
                i += parallel

    def run(n: int, obj_list: list[ObjectInfo]) -> float:
        counter, lock = [0], threading.Lock()
        t0 = time.perf_counter()
        deadline = t0 + seconds
        threads = [threading.Thread(target=stream, args=(obj_list, deadline, counter, lock, k))
                   for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return counter[0] / (time.perf_counter() - t0)

    single = run(1, [largest])
    big_first = sorted(objects, key=lambda o: -o.size)
    multi = run(parallel, big_first)
    return {
        "source": f"s3://{store.bucket}/{prefix}",
        "objects_seen": len(objects),
        "list_latency_s": list_latency,
        "get_latency_p50_s": statistics.median(lat),
        "get_latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
        "single_stream_bytes_per_s": single,
        "parallel_streams": parallel,
        "parallel_bytes_per_s": multi,
        "seconds_per_test": seconds,
    }


def probe_main(args: Any) -> int:
    url = parse_s3_url(args.source)
    if args.samples < 1 or args.parallel < 1 or args.seconds <= 0:
        raise ConfigError("--samples, --parallel and --seconds must be positive")
    if not math.isfinite(args.seconds):  # nan measures nothing; inf never ends
        raise ConfigError(f"--seconds must be a finite number, not {args.seconds}")
    # (a thread and a connection per stream; the samples are taken one after the other)
    for flag, value, most in (("--parallel", args.parallel, PARALLEL_MAX),
                              ("--samples", args.samples, SAMPLES_MAX),
                              ("--seconds", args.seconds, SECONDS_MAX)):
        if value > most:
            raise ConfigError(f"{flag} {value:g}: at most {most}")
    store = S3Store(url.bucket, endpoint_url=args.endpoint_url, region=args.region,
                    max_connections=max(args.parallel, 4), anonymous=args.no_sign_request)
    if args.region is None:
        store = store.in_bucket_region()
    try:
        result = probe(store, url.prefix, samples=args.samples, parallel=args.parallel,
                       seconds=args.seconds)
    except StoreError as exc:
        raise StoreError(f"probe of {url} failed: {exc}") from None
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    mb = 1e6
    print(f"probe of {result['source']} ({result['objects_seen']} objects seen)")
    print(f"  LIST latency            {1000 * result['list_latency_s']:8.1f} ms")
    print(f"  GET latency p50 / p90   {1000 * result['get_latency_p50_s']:8.1f} ms / "
          f"{1000 * result['get_latency_p90_s']:.1f} ms")
    print(f"  single stream           {result['single_stream_bytes_per_s'] / mb:8.1f} MB/s")
    print(f"  {args.parallel:>3} parallel streams     "
          f"{result['parallel_bytes_per_s'] / mb:8.1f} MB/s")
    print("feed these to 'cachefs plan' (or save --json output and pass --probe FILE)")
    return 0
