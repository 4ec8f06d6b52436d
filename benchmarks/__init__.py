"""Benchmark harness: training reads from a remote region vs co-located, with peers.

Modules, one job each:

- ``origin``   SeaweedFS ``weed mini`` on free loopback ports (a context manager).
- ``wan``      user-space WAN emulator (TCP proxy adding RTT and capping bandwidth).
- ``datasets`` deterministic image-like and tar-shard datasets, uploaded once.
- ``systems``  cachefs, rclone mount, s3fs-fuse and local disk as context managers.
- ``reader``   the PyTorch DataLoader reader, run as a subprocess per system/link.
- ``report``   metrics, warm-up detection, plot and ``RESULTS.md`` table.
- ``run``      the command line: ``python -m benchmarks.run [--quick] ...``.
- ``cluster``  four cachefs nodes, a remote origin and a shared in-region tier:
               ``python -m benchmarks.cluster [--quick]`` (``make bench-cluster``).
"""
