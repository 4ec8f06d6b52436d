"""The open-file budget (cachefs/descriptors.py): the daemon raises its soft limit, bounds
the cache files registered for reads in C by what the limit leaves, and serves every read
when the budget still runs out.

The bug: without passthrough, each cache file registered for reads in C held up to three
descriptors while idle, and up to 65,536 were kept; a walk over 14,000 small files ran a
daemon with a 20,000-descriptor limit out of them, and opens failed with EIO.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cachefs import descriptors
from cachefs.fuse import native
from tests.conftest import drop_page_cache, read_unbuffered, run_cachefs, s3_client

#: The daemon's open-file limit in the mount test, hard and soft: given at start (room
#: for 344 registered files), or set under a running daemon, whose bound (computed from
#: the limit it started with) is then too high for 700 files.
LIMIT = 1400
LOWERED = 500
CONNECTIONS = 16


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = ("import resource; from cachefs import descriptors; "
            "print(descriptors.raise_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, preexec_fn=lower).stdout.split()
    assert out == ["4096", "4096"]


def test_registered_files_get_what_the_reserve_leaves() -> None:
    reserve = descriptors.reserved(CONNECTIONS)
    assert reserve == 2 * CONNECTIONS + descriptors.FIXED_RESERVE
    assert descriptors.native_files(reserve + 300, CONNECTIONS) == 300 // descriptors.PER_NATIVE_FILE
    assert descriptors.native_files(reserve - 1, CONNECTIONS) == 0


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def walk_bucket(s3_endpoint: str) -> Iterator[tuple[str, dict[str, bytes], Any]]:
    """(bucket, {key: body}, the random state after making them): 700 small files in 8
    folders, read (never written) by both walks below. Uploaded once for the module, before
    a walk's test holds the page cache for itself (tests/conftest.py)."""
    rnd = random.Random(5)
    files = {f"c{i % 8}/f{i:04d}.bin": rnd.randbytes(2000 + rnd.randrange(6000))
             for i in range(700)}
    client = s3_client(s3_endpoint)
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=name, Key=kv[0], Body=kv[1]),
                      files.items()))
    yield name, files, rnd.getstate()


@pytest.mark.slow
@pytest.mark.skipif(not native.AVAILABLE and not os.environ.get("CI"),
                    reason="cachefs was built without its native loop")
@pytest.mark.drops_caches
@pytest.mark.xdist_group("descriptors-walk")  # (one worker: one upload of walk_bucket)
@pytest.mark.parametrize("when", ["at-start", "while-mounted"])
def test_a_walk_over_more_files_than_descriptors_reads_every_byte(walk_bucket, mount_factory, when) -> None:  # type: ignore[no-untyped-def]
    """At start, the daemon bounds its registered files by the limit it was given; a limit
    lowered under a running daemon (its bound then too high) is met with EMFILE, and the
    daemon shrinks its bound instead of failing the opens."""
    name, files, state = walk_bucket
    rnd = random.Random()
    rnd.setstate(state)
    # Without passthrough: verified files are registered with the native loop, each
    # holding a descriptor while idle.
    m = mount_factory(f"s3://{name}", "--passthrough", "off",
                      "--max-connections", str(CONNECTIONS), start=False)
    if when == "at-start":
        m.preexec_fn = _limit_open_files
    m.start()
    status = run_cachefs("status", "--json", str(m.path))
    pid = int(json.loads(status.stdout)["pid"])
    limit = LIMIT if when == "at-start" else LOWERED
    if when == "while-mounted":
        assert len(os.listdir(f"/proc/{pid}/fd")) < LOWERED - 200
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (LOWERED, LOWERED))
    for epoch in range(3):
        order = sorted(files) if epoch < 2 else rnd.sample(sorted(files), len(files))
        for rel in order:
            assert read_unbuffered(m.path / rel) == files[rel], (epoch, rel)
        drop_page_cache()
    assert len(os.listdir(f"/proc/{pid}/fd")) < limit
    assert m.metric('cachefs_fuse_native_answers_total{op="read"}') > 0, "files were read in C"
    assert "unexpected error" not in m.log()
    if when == "at-start":
        bound = descriptors.native_files(LIMIT, CONNECTIONS)
        assert 0 < m.metric("cachefs_passthrough_backing_files") <= bound
        assert "Too many open files" not in m.log()
    else:
        assert "out of open files: keeping at most" in m.log()
