"""CPU per GET: cachefs's lean S3 client against urllib3's connection pool.

Both sign with botocore's SigV4 signer and read from one SeaweedFS server on
loopback (a separate process, so the CPU measured is the client's alone); one
thread, kept-alive connections, the same object again and again. Run::

    python -m benchmarks.getcpu [--rounds 3]

It prints CPU microseconds per request for a 110 KB object (an ImageNet-sized
file, where the daemon's CPU per file bounds throughput on 2 cores) and a
4 MiB block. This is how cachefs chose to keep its ``http.client`` path
rather than urllib3's pool (see cachefs/s3/connections.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.origin import ACCESS_KEY, REGION, SECRET_KEY, SeaweedOrigin

BUCKET = "getcpu"
SIZES = {"110KB": 110_000, "4MiB": 4 << 20}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def lean(endpoint: str) -> Callable[[str, str, int], bytes]:
    import botocore.credentials

    from cachefs.s3.ranges import RangeClient

    client = RangeClient(BUCKET, endpoint_url=endpoint, region=REGION,
                         credentials=botocore.credentials.Credentials(ACCESS_KEY, SECRET_KEY),
                         anonymous=False, max_connections=4, connect_timeout=5, read_timeout=30)
    return lambda key, etag, n: client.get_range(key, etag, 0, n)


def pooled(endpoint: str) -> Callable[[str, str, int], bytes]:
    import botocore.credentials
    import urllib3
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    creds = botocore.credentials.Credentials(ACCESS_KEY, SECRET_KEY)
    host, port = endpoint.removeprefix("http://").split(":")
    pool = urllib3.HTTPConnectionPool(host, int(port), maxsize=4)

    def get(key: str, etag: str, n: int) -> bytes:
        path = f"/{BUCKET}/{key}"
        req = AWSRequest("GET", endpoint + path,
                         headers={"Range": f"bytes=0-{n - 1}", "If-Match": f'"{etag}"'})
        S3SigV4Auth(creds.get_frozen_credentials(), "s3", REGION).add_auth(req)
        resp = pool.urlopen("GET", path, headers=dict(req.headers.items()), retries=False,
                            redirect=False, preload_content=True, decode_content=False)
        if len(resp.data) != n:
            raise RuntimeError(f"short answer: {len(resp.data)} bytes")
        return bytes(resp.data)
    return get


def measure(get: Callable[[str, str, int], bytes], key: str, etag: str, n: int,
            count: int) -> float:
    for _ in range(max(10, count // 20)):
        get(key, etag, n)
    c0 = _cpu()
    for _ in range(count):
        get(key, etag, n)
    return (_cpu() - c0) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SeaweedOrigin(Path(tmp), bucket=BUCKET) as origin:
        s3 = origin.client()
        etags = {}
        for name, n in SIZES.items():
            s3.put_object(Bucket=BUCKET, Key=name, Body=os.urandom(n))
            etags[name] = s3.head_object(Bucket=BUCKET, Key=name)["ETag"].strip('"')
        clients = {"cachefs http.client": lean(origin.endpoint),
                   "urllib3 pool": pooled(origin.endpoint)}
        results: dict[tuple[str, str], list[float]] = {}
        t0 = time.monotonic()
        for _ in range(args.rounds):  # interleaved rounds: drift hits both alike
            for cname, get in clients.items():
                for name, n in SIZES.items():
                    count = 1500 if n < 1 << 20 else 150
                    results.setdefault((cname, name), []).append(
                        measure(get, name, etags[name], n, count))
        print(f"CPU per GET (median of {args.rounds} rounds, µs; {time.monotonic() - t0:.0f} s)")
        for (cname, name), values in results.items():
            values.sort()
            print(f"  {cname:22s} {name:6s} {values[len(values) // 2]:7.0f}   "
                  f"(all: {', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
