"""Readers walking a tree of more than one level of folders in name order, on a real mount:
the directory lookahead follows them from one parent folder into the next."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = [pytest.mark.fuse]

PARENTS, FOLDERS, FILES, SIZE = 12, 2, 10, 8_000


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def test_a_walk_through_a_tree_of_two_levels_goes_on_from_parent_to_parent(  # type: ignore[no-untyped-def]
        bucket, mount_factory) -> None:
    """A pool of readers reads ``p00/c000/`` .. ``p00/c001/``, ``p01/c002/`` .. in name order
    (a dataset grouped in two levels of folders). The lookahead's walks went on only into
    the next folder of the same parent: at each parent's last folder they ended, and the
    readers of the next parent's first folder proved their order again, fetching its
    first files on demand (one round trip each across regions, while the GETs in flight
    drained). Every file after the first parent is requested ahead of its readers now."""
    client, name = bucket
    files: dict[str, bytes] = {}
    for p in range(PARENTS):
        for c in range(FOLDERS):
            folder = f"tree/p{p:02d}/c{p * FOLDERS + c:03d}"
            for i in range(FILES):
                key = f"{folder}/f{i:02d}.bin"
                files[key] = _payload(len(files), SIZE)
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}/tree")

    def read(key: str) -> bytes:
        return (m.path / key[len("tree/"):]).read_bytes()

    order = sorted(files)
    with ThreadPoolExecutor(4) as pool:  # a pool of readers taking turns over one list
        got = list(pool.map(read, order))
    assert got == [files[k] for k in order]
    issued = m.metric('cachefs_prefetch_issued_bytes_total{policy="directory"}')
    after_first = (PARENTS - 1) * FOLDERS * FILES  # the files of every parent but the first
    # (before: 124 files in all were requested ahead; the first files of each later
    # parent's first folder were read on demand; after: 226-233 in four runs)
    assert issued >= (after_first - 4) * SIZE, \
        f"{issued / SIZE:.0f} files requested ahead, of {after_first} after the first parent"

