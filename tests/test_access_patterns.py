"""Readers that do not read whole files front to back: memory maps, random preads, several
threads at random offsets of one file. Every byte is compared with the object's."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cachefs.passthrough import supported as passthrough_supported

BLOCK = 65536

# The mapped file is read in a child process: a page fault of a FUSE file in this process
# would stall while holding the GIL, which the in-process S3 server (moto) needs to answer.
_MAP_AND_HASH = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print(hashlib.sha256(mm[:]).hexdigest())
    mm.close()
"""


def _mapped_sha256(path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", _MAP_AND_HASH, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.fuse
@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_mapped_and_randomly_read_files_match_their_objects_cold_and_warm(
        bucket: Any, mount_factory: Any, passthrough: str) -> None:
    """A multi-block file and a one-block file, each read through a memory map and by
    random preads (past the end included), three times: cold, then cached (with
    passthrough on, handed to the kernel once closed)."""
    client, name = bucket
    rnd = random.Random(1)
    files = {"d/big.bin": rnd.randbytes(3 * BLOCK + 1234), "d/small.bin": rnd.randbytes(5000)}
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", passthrough)
    for round_ in range(3):
        for key, data in files.items():
            path = m.path / key
            assert _mapped_sha256(path) == hashlib.sha256(data).hexdigest(), (key, round_)
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(200):
                    offset, size = rnd.randrange(len(data) + 10), rnd.randrange(70000)
                    assert os.pread(fd, size, offset) == data[offset:offset + size], (key, offset)
            finally:
                os.close(fd)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    if passthrough == "auto" and passthrough_supported():
        # the later rounds' maps and reads went to the cache files through the kernel
        assert m.metric("cachefs_passthrough_opens_total") > 0


@pytest.mark.fuse
def test_threads_reading_random_ranges_of_one_file_get_exact_bytes(
        bucket: Any, mount_factory: Any) -> None:
    """Eight threads, each with its own descriptor, read random ranges (up to several
    blocks) of one 40-block file while its blocks are being fetched."""
    client, name = bucket
    data = random.Random(2).randbytes(40 * BLOCK + 77)
    client.put_object(Bucket=name, Key="big.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")

    def reader(seed: int) -> int:
        r = random.Random(seed)
        fd = os.open(m.path / "big.bin", os.O_RDONLY)
        try:
            for _ in range(150):
                offset, size = r.randrange(len(data)), r.randrange(1, 300_000)
                assert os.pread(fd, size, offset) == data[offset:offset + size], (offset, size)
        finally:
            os.close(fd)
        return seed

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(reader, range(8))) == list(range(8))
    assert (m.path / "big.bin").read_bytes() == data
    # single flight: no block was fetched twice (40 blocks + the whole-file check reads)
    assert m.gets() <= 41


@pytest.mark.fuse
@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_a_file_of_default_sized_blocks_reads_exactly_cold_and_warm(
        bucket: Any, mount_factory: Any, passthrough: str) -> None:
    """Blocks of the default size (4 MiB) come in bodies large enough to be received in
    place (cachefs.s3.http1.IN_PLACE_BODY): read at random offsets and whole, cold (from
    S3, checked against the object's CRC), then from the cache and the memory tier."""
    client, name = bucket
    data = random.Random(3).randbytes(9 * (1 << 20) + 4321)  # two full blocks and a tail
    client.put_object(Bucket=name, Key="big.bin", Body=data, ChecksumAlgorithm="CRC32")
    m = mount_factory(f"s3://{name}", "--passthrough", passthrough)
    rnd = random.Random(4)
    for round_ in range(2):
        fd = os.open(m.path / "big.bin", os.O_RDONLY)
        try:
            for _ in range(40):
                offset, size = rnd.randrange(len(data)), rnd.randrange(1, 3 << 20)
                assert os.pread(fd, size, offset) == data[offset:offset + size], (round_, offset)
        finally:
            os.close(fd)
        assert (m.path / "big.bin").read_bytes() == data, round_
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    assert m.gets() == 3  # one GET per block, then everything from the cache


@pytest.mark.fuse
def test_random_reads_of_a_large_file_fetch_their_pieces_not_whole_blocks(
        bucket: Any, mount_factory: Any) -> None:
    """Small reads at random offsets of a 12-block file fetch about what they read, not a
    block each; the file read whole afterwards is exact and cached (read again: no GET)."""
    client, name = bucket
    mib = 1 << 20
    data = random.Random(5).randbytes(12 * mib + 999)
    client.put_object(Bucket=name, Key="big.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "1M", "--passthrough", "off")
    fd = os.open(m.path / "big.bin", os.O_RDONLY)
    try:
        # one read in each of blocks 11..1, each 1 MiB + 64 KiB before the last: random
        # (more than the sequential tolerance back), so none is read ahead either
        for i in range(11, 0, -1):
            offset = i * mib + 300_000
            assert os.pread(fd, 4096, offset) == data[offset:offset + 4096], i
    finally:
        os.close(fd)
    pieces = m.metric("cachefs_piece_reads_total")
    assert pieces >= 10, pieces
    fetched = m.metric("cachefs_s3_bytes_total")
    assert fetched < 2 * mib, fetched  # ~11 pieces of a few KiB (the kernel's reads), not 11 MiB
    assert (m.path / "big.bin").read_bytes() == data
    deadline = time.monotonic() + 30  # (written back to the disk cache after the reads)
    while m.metric("cachefs_cache_blocks") < 13 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.metric("cachefs_cache_blocks") == 13  # every block cached whole: no piece kept
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.fuse
@pytest.mark.slow
def test_page_faults_of_a_memory_map_a_few_mib_apart_read_only_their_blocks(
        bucket: Any, mount_factory: Any) -> None:
    """Page faults of a memory map in every third block, each fault's 1 MiB read-around a
    few MiB after the one before (inside the sequential detector's forward tolerance):
    each touched block's first fault is a piece and its second loads it (its pieces
    reached 1/8 of it), and no block is read ahead: a run that skips more than it reads
    is no sequential reader. Counted as one before, the faults opened a window and
    fetched the blocks between."""
    client, name = bucket
    mib = 1 << 20
    data = random.Random(6).randbytes(80 * mib + 999)
    client.put_object(Bucket=name, Key="tokens.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "4M", "--passthrough", "off")
    touched = range(1, 18, 3)  # blocks 1, 4, ..., 16
    # 1 MiB and 3 MiB into each (read-arounds of [0.5, 1.5) and [2.5, 3.5) MiB of the block)
    offsets = [block * 4 * mib + into for block in touched for into in (1 * mib, 3 * mib)]
    # (faulted in a child: a slice of a memory map holds the interpreter lock through its
    # faults, and this process runs the S3 server the daemon reads from)
    child = ("import mmap, os, sys\n"
             "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\n"
             "for offset in map(int, sys.argv[2:]):\n"
             "    sys.stdout.buffer.write(mapped[offset:offset + 64])\n")
    got = subprocess.run([sys.executable, "-c", child, str(m.path / "tokens.bin"),
                          *map(str, offsets)], capture_output=True, timeout=120, check=True)
    assert got.stdout == b"".join(data[o:o + 64] for o in offsets)
    assert m.metric("cachefs_piece_reads_total") >= len(touched)
    deadline = time.monotonic() + 30  # (written back to the disk cache after the reads)
    while m.metric("cachefs_cache_blocks") < len(touched) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # (a window's loads would land by now too)
    assert m.metric("cachefs_cache_blocks") == len(touched)  # nothing read ahead
    fetched = m.metric("cachefs_s3_bytes_total")
    assert fetched < len(touched) * 6 * mib, fetched  # a piece and the block, each
