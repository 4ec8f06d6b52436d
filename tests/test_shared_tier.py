"""The shared cache tier on real mounts: origin = moto, shared tier = a real SeaweedFS.

Two S3 servers on loopback, each mount its own daemon process with its own
empty cache, as separate nodes of one cluster would be. Covered: publishing,
read-through from the tier (a second node sends no GET to the origin), version
isolation, corrupt and foreign tier objects, the tier going down mid-read
(no failed read, one breaker line each way), ``warm --shard`` on several
mounts, fetch leases for concurrent misses, and SeaweedFS honouring
``If-None-Match: *`` under a race.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, run_cachefs
from tests.faultproxy import FaultProxy

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.origin import SeaweedOrigin, s3_client  # noqa: E402

pytestmark = pytest.mark.fuse

BS = 64 * 1024  # small blocks: several per file, quick tests


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedOrigin]:
    """One SeaweedFS (``weed mini`` on loopback ports of its own) for the session."""
    origin = SeaweedOrigin(tmp_path_factory.mktemp("seaweed"))
    try:
        origin.start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    yield origin
    origin.stop()


@pytest.fixture
def tier(seaweed: SeaweedOrigin) -> tuple[Any, str]:
    """A fresh bucket on the shared store: (client, name)."""
    client = seaweed.client()
    name = f"tier-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=name)
    return client, name


def _dataset(client: Any, bucket: str, files: int = 6, seed: int = 1) -> dict[str, bytes]:
    rnd = random.Random(seed)
    data = {f"ds/f{i}.bin": rnd.randbytes(BS * (1 + i % 3) + 1000 * i) for i in range(files)}
    for k, v in data.items():
        client.put_object(Bucket=bucket, Key=k, Body=v)
    return data


def _blocks(data: dict[str, bytes]) -> int:
    return sum((len(v) + BS - 1) // BS for v in data.values())


def _shared_args(endpoint: str, bucket: str, *extra: str) -> list[str]:
    # A generous latency budget: this machine is shared, and a breaker tripped by a
    # scheduling hiccup would send reads to the origin (correct, but not what is tested).
    return ["--block-size", "64K", "--shared-cache", f"s3://{bucket}/cache",
            "--shared-cache-endpoint-url", endpoint, "--shared-cache-timeout", "10s", *extra]


def _wait(cond: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _published(m: Mount) -> float:
    return m.metric('cachefs_shared_publishes_total{result="stored"}')


def _tier_objects(client: Any, bucket: str) -> dict[str, dict[str, Any]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                   Prefix="cache/v1/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = o
    return out


def _read_all(m: Mount, data: dict[str, bytes]) -> None:
    for key, expected in data.items():
        assert (m.path / key).read_bytes() == expected, key


def test_blocks_are_published_and_a_second_node_reads_them_from_the_tier(
        bucket, tier, seaweed, mount_factory):
    client, name = bucket
    tclient, tname = tier
    data = _dataset(client, name)
    blocks = _blocks(data)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(a, data)
    assert a.gets() == blocks
    _wait(lambda: _published(a) == blocks, what="publishes")
    objects = _tier_objects(tclient, tname)
    assert len(objects) == blocks
    head = tclient.head_object(Bucket=tname, Key=next(iter(objects)))
    assert head["Metadata"]["cachefs-block"].startswith("v1:")

    b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(b, data)
    assert b.gets() == 0  # not one GET to the origin
    total = sum(len(v) for v in data.values())
    assert b.metric('cachefs_tier_loads_total{tier="shared"}') == blocks
    assert b.metric('cachefs_tier_loads_total{tier="s3"}') == 0
    assert b.metric('cachefs_shared_lookups_total{result="hit"}') == blocks
    assert b.metric("cachefs_shared_get_bytes_total") == total

    # Read again: now from B's own disk cache, nothing more from the tier.
    _read_all(b, data)
    assert b.metric('cachefs_shared_lookups_total{result="hit"}') == blocks
    def status() -> dict[str, Any]:
        st = run_cachefs("status", "--json", str(b.path))
        assert st.returncode == 0, st.stderr
        return json.loads(st.stdout)["shared"]  # type: ignore[no-any-return]

    _wait(lambda: status()["hit_bytes"] == total, what="status snapshot")  # every second
    shared = status()
    assert shared["url"] == f"s3://{tname}/cache/" and shared["breaker"] == "closed"
    assert shared["hit_bytes"] == total and shared["conditional_writes"] is True
    text = run_cachefs("status", str(b.path)).stdout
    assert f"shared  s3://{tname}/cache/ (breaker closed)" in text, text


def test_a_new_object_version_never_gets_old_blocks(bucket, tier, seaweed, mount_factory):
    client, name = bucket
    _, tname = tier
    old = random.Random(2).randbytes(3 * BS)
    client.put_object(Bucket=name, Key="v.bin", Body=old)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    assert (a.path / "v.bin").read_bytes() == old
    _wait(lambda: _published(a) == 3, what="publishes")
    new = random.Random(3).randbytes(3 * BS)
    client.put_object(Bucket=name, Key="v.bin", Body=new)  # same size, new ETag

    b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    assert (b.path / "v.bin").read_bytes() == new
    assert b.gets() == 3  # the old version's blocks were not taken
    assert b.metric('cachefs_tier_loads_total{tier="shared"}') == 0
    _wait(lambda: _published(b) == 3, what="publishes of the new version")
    assert len(_tier_objects(tier[0], tname)) == 6  # both versions, apart


def test_corrupt_and_foreign_tier_objects_are_misses_and_get_replaced(
        bucket, tier, seaweed, mount_factory):
    client, name = bucket
    tclient, tname = tier
    data = _dataset(client, name, files=3)
    blocks = _blocks(data)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(a, data)
    _wait(lambda: _published(a) == blocks, what="publishes")
    keys = sorted(_tier_objects(tclient, tname))
    corrupt, foreign = keys[0], keys[1]
    obj = tclient.get_object(Bucket=tname, Key=corrupt)
    body = bytearray(obj["Body"].read())
    body[100] ^= 0xFF  # one flipped bit, stamp kept
    tclient.put_object(Bucket=tname, Key=corrupt, Body=bytes(body), Metadata=obj["Metadata"])
    tclient.put_object(Bucket=tname, Key=foreign, Body=b"not a cachefs block")

    b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(b, data)  # exact bytes despite the bad objects
    assert b.metric('cachefs_shared_lookups_total{result="corrupt"}') == 1
    assert b.metric('cachefs_shared_lookups_total{result="foreign"}') == 1
    assert b.gets() == 2  # just the two bad blocks, from the origin
    _wait(lambda: _published(b) == 2, what="replacement publishes")

    c = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(c, data)
    assert c.gets() == 0  # the tier holds good copies again
    assert c.metric('cachefs_shared_lookups_total{result="hit"}') == blocks


def _fuse_errors(m: Mount) -> float:
    return sum(v for k, v in m.metrics().items() if k.startswith("cachefs_fuse_errors_total"))


@pytest.mark.slow
def test_tier_going_down_mid_read_fails_no_read(bucket, tier, seaweed, mount_factory):
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=12, seed=4)
    # Read out of directory order (every third name, then the next ones): a walk in order
    # would make the directory lookahead load the files of the next phase from the tier
    # before it goes down, and that phase would send the tier no request.
    names = sorted(data)
    keys = [names[i] for i in (0, 6, 3, 9, 1, 7, 4, 10, 2, 8, 5, 11)]
    # One directory each, read in no order (below): readers going through folders in order
    # are followed across them, and a lookahead would load them all at once, sending the
    # tier no request later on.
    # Each larger than a block: misses scattered over folders start a sweep of small files,
    # which would have them all cached before the store answers again, and no read would
    # send the breaker's trial.
    later = {f"later/{i:03d}/f.bin": random.Random(100 + i).randbytes(BS + BS // 4)
             for i in range(120)}
    for k, v in later.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    with FaultProxy(seaweed.endpoint) as proxy:
        a = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname))
        _read_all(a, data)  # publishes everything
        _read_all(a, later)
        _wait(lambda: _published(a) == _blocks(data) + _blocks(later), what="publishes")
        b = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname,
                                                        "--shared-cache-timeout", "3s"))
        for key in keys[:4]:
            assert (b.path / key).read_bytes() == data[key]
        assert b.gets() == 0, b.log()
        proxy.plan = lambda method, path, n: "down"  # connections reset from now on
        for key in keys[4:8]:
            assert (b.path / key).read_bytes() == data[key]  # from the origin, no error
        assert b.metric("cachefs_shared_breaker_open") == 1
        assert b.gets() > 0
        proxy.plan = lambda method, path, n: "stall"  # accepts, then answers nothing
        for key in keys[8:]:
            assert (b.path / key).read_bytes() == data[key]
        pending = sorted(later)
        random.Random(9).shuffle(pending)

        def timeouts() -> float:
            return (b.metric('cachefs_shared_lookups_total{result="timeout"}')
                    + b.metric('cachefs_shared_publishes_total{result="failed"}'))

        # After each cooldown the breaker lets one trial request through (reads of files
        # not cached yet are what send requests): into the stall first, then, once the
        # store answers again, one that succeeds and closes it.
        while timeouts() == 0 and len(pending) > 60:
            key = pending.pop(0)
            assert (b.path / key).read_bytes() == later[key]
            time.sleep(0.5)
        assert timeouts() >= 1
        proxy.plan = lambda method, path, n: "pass"
        deadline = time.monotonic() + 40  # the longest cooldown is 10 s
        while b.metric("cachefs_shared_breaker_open") == 1 and time.monotonic() < deadline:
            key = pending.pop(0)
            assert (b.path / key).read_bytes() == later[key]
            time.sleep(0.5)
        assert b.metric("cachefs_shared_breaker_open") == 0
        assert _fuse_errors(b) == 0
        # One line each time the breaker opens and each time it closes (failed trials in
        # between log nothing); a loaded machine may add a cycle in the healthy phases.
        log = b.log()
        opens = b.metric("cachefs_shared_breaker_opens_total")
        assert opens >= 1 and log.count("circuit breaker open") == opens, log
        assert log.count("circuit breaker closed") == opens, log


def test_warm_shard_on_three_nodes_then_a_fourth_reads_without_the_origin(
        bucket, tier, seaweed, mount_factory):
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=12, seed=5)
    blocks = _blocks(data)
    nodes = [mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
             for _ in range(3)]
    results: list[Any] = [None] * 3

    def warm(i: int) -> None:
        results[i] = run_cachefs("warm", str(nodes[i].path), "--shard", f"{i}/3")

    threads = [threading.Thread(target=warm, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r.returncode == 0, r.stderr
        assert "warmed shard" in r.stdout
    assert sum(m.gets() for m in nodes) == blocks  # each block crossed once
    assert all(m.gets() > 0 for m in nodes)  # and the work was shared
    published = sum(_published(m) for m in nodes)
    assert published == blocks

    fourth = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(fourth, data)
    assert fourth.gets() == 0
    # The same shard again fetches nothing more from the origin (resumable).
    gets = nodes[0].gets()
    again = run_cachefs("warm", str(nodes[0].path), "--shard", "0/3")
    assert again.returncode == 0, again.stderr
    assert nodes[0].gets() == gets


def test_warm_shard_needs_a_shared_tier_and_a_valid_shard(bucket, mount_factory):
    client, name = bucket
    _dataset(client, name, files=1)
    m = mount_factory(f"s3://{name}")
    r = run_cachefs("warm", str(m.path), "--shard", "0/2")
    assert r.returncode != 0 and "no shared cache tier" in r.stderr, r.stderr
    for bad in ("2/2", "x/3", "1", "-1/3"):
        r = run_cachefs("warm", str(m.path), "--shard", bad)
        assert r.returncode == 2 and "--shard" in r.stderr and "Traceback" not in r.stderr


def test_concurrent_misses_of_one_file_cost_one_origin_fetch(bucket, tier, seaweed,
                                                             mount_factory):
    client, name = bucket
    _, tname = tier
    big = random.Random(6).randbytes(16 * BS)
    client.put_object(Bucket=name, Key="big.bin", Body=big)
    # A 30 s budget: a miss waits up to 3 s for its lease's answer, so a lease write that a
    # loaded machine delays past a second is still answered before the miss goes ahead.
    nodes = [mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname),
                           "--shared-cache-timeout", "30s")
             for _ in range(3)]
    for m in nodes:  # listings cached: the reads below start at the same moment
        assert (m.path / "big.bin").stat().st_size == len(big)
    barrier = threading.Barrier(3)
    got: list[bytes] = [b""] * 3

    def read(i: int) -> None:
        barrier.wait()
        got[i] = (nodes[i].path / "big.bin").read_bytes()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == big for g in got)
    def total(result: str) -> float:
        return sum(m.metric(f'cachefs_shared_leases_total{{result="{result}"}}') for m in nodes)

    origin = sum(m.gets() for m in nodes)
    # Each origin GET is explained: the lease winner's, a node's that went ahead before
    # its lease was answered (raced), or a waiter's that gave up.
    assert total("error") == 0 and total("skipped") == 0
    assert origin == total("won") + total("raced") + total("lost_timeout")
    # One winner per block (a lease window turning over mid-test may add one); with a
    # 30 s budget a miss waits up to 3 s for its lease's answer: no races.
    assert 16 <= total("won") <= 17 and total("raced") == 0
    hits = sum(m.metric('cachefs_shared_lookups_total{result="hit"}') for m in nodes)
    assert hits + origin >= 3 * 16  # every node got every block from somewhere


def test_seaweedfs_honours_if_none_match_under_a_race(seaweed, tier):
    from concurrent.futures import ThreadPoolExecutor

    import botocore.exceptions

    _, tname = tier
    client = s3_client(seaweed.endpoint, max_pool=16)
    rounds, writers = 5, 8
    winners = []
    for r in range(rounds):
        barrier = threading.Barrier(writers)

        def put(i: int, r: int = r, barrier: threading.Barrier = barrier) -> int:
            barrier.wait()
            try:
                client.put_object(Bucket=tname, Key=f"race/{r}", Body=str(i).encode(),
                                  IfNoneMatch="*")
                return 1
            except botocore.exceptions.ClientError as exc:
                assert exc.response["ResponseMetadata"]["HTTPStatusCode"] in (409, 412)
                return 0

        with ThreadPoolExecutor(writers) as pool:
            winners.append(sum(pool.map(put, range(writers))))
    assert winners == [1] * rounds


def test_a_tier_that_is_down_from_the_start_never_stops_the_mount(bucket, mount_factory):
    from tests.conftest import free_port

    client, name = bucket
    data = _dataset(client, name, files=3, seed=7)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--shared-cache", "s3://cache/x",
                      "--shared-cache-endpoint-url", dead)
    _read_all(m, data)
    assert m.gets() == _blocks(data)
    assert _fuse_errors(m) == 0
    log = m.log()
    assert "start-up check failed" in log and log.count("circuit breaker open") == 1


def test_a_bad_shared_cache_profile_is_one_line(bucket, mount_factory):
    _, name = bucket
    m = mount_factory(f"s3://{name}", "--shared-cache", "s3://cache/x",
                      "--shared-cache-profile", "no-such-profile", start=False)
    proc = run_cachefs("mount", m.source, str(m.path), "--cache-dir", str(m.cache_dir),
                       "--endpoint-url", m.endpoint, *m.extra)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("cachefs: error: --shared-cache-profile: AWS profile "
                                   "'no-such-profile' not found"), proc.stderr


def test_blocks_received_in_place_are_published_and_read_by_a_second_node(
        bucket, tier, seaweed, mount_factory):
    """Blocks of 1 MiB come from S3 in bodies received in place (a bytearray, see
    cachefs.s3.http1.IN_PLACE_BODY): they are published as they are and read back exactly."""
    client, name = bucket
    _, tname = tier
    data = {"ds/big.bin": random.Random(7).randbytes((5 << 20) // 2)}  # 2.5 blocks
    client.put_object(Bucket=name, Key="ds/big.bin", Body=data["ds/big.bin"])
    args = [*_shared_args(seaweed.endpoint, tname), "--block-size", "1M"]  # (the last wins)
    a = mount_factory(f"s3://{name}", *args)
    _read_all(a, data)
    assert a.gets() == 3
    _wait(lambda: _published(a) == 3, what="publishes")
    b = mount_factory(f"s3://{name}", *args)
    _read_all(b, data)
    assert b.gets() == 0
    assert b.metric('cachefs_tier_loads_total{tier="shared"}') == 3


def _wipe_tier(tclient: Any, tname: str) -> int:
    """Delete every block of the tier (a tier that lost its data): how many there were."""
    keys = list(_tier_objects(tclient, tname))
    for key in keys:
        tclient.delete_object(Bucket=tname, Key=key)
    assert not _tier_objects(tclient, tname)
    return len(keys)


def _node_warmed_into_the_tier(bucket: Any, tier: Any, seaweed: Any, mount_factory: Any,
                               files: int, seed: int) -> tuple[Any, dict[str, bytes], int]:
    """A node over a dataset of ``files`` objects, its whole share warmed into the tier
    (``warm --shard 0/1``); returns (the node, the dataset, its number of blocks)."""
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=files, seed=seed)
    node = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    first = run_cachefs("warm", str(node.path), "--shard", "0/1")
    assert first.returncode == 0, first.stderr
    return node, data, _blocks(data)


def test_warm_shard_again_after_the_tier_lost_its_blocks_puts_them_back(
        bucket, tier, seaweed, mount_factory):
    """An operator's remedy for a tier that lost its data (a store restarted on emptied
    disks, a bucket emptied by hand or by a lifecycle rule) is to run the warm again: it
    must put the share back, not report from memory that the blocks are there."""
    _, name = bucket
    tclient, tname = tier
    node, data, blocks = _node_warmed_into_the_tier(bucket, tier, seaweed, mount_factory, 6, 7)
    assert len(_tier_objects(tclient, tname)) == blocks
    assert _wipe_tier(tclient, tname) == blocks

    again = run_cachefs("warm", str(node.path), "--shard", "0/1")
    assert again.returncode == 0, again.stderr
    assert len(_tier_objects(tclient, tname)) == blocks, again.stdout
    gets = node.gets()
    assert gets == blocks  # put back from this node's disk, not fetched again

    # Another node reads every byte from the tier, none from the origin.
    other = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(other, data)
    assert other.gets() == 0


def test_a_tier_that_throttles_writes_still_serves_reads(bucket, tier, seaweed, mount_factory):
    """A tier answering 503 SlowDown to writes (every node publishing at once in the first
    epoch, or a store out of space that says so with a 503) still answers reads: the
    blocks other nodes put there are read from it, not fetched again from the origin."""
    client, name = bucket
    _, tname = tier
    old = _dataset(client, name, files=6, seed=11)
    rnd = random.Random(12)
    new = {f"new/g{i}.bin": rnd.randbytes(BS * 2 + 100 * i) for i in range(6)}
    for k, v in new.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(a, old)
    # (The directory lookahead may load and publish some of new/ too.)
    _wait(lambda: _published(a) >= _blocks(old)
          and a.metric("cachefs_shared_publish_queue_blocks") == 0, what="publishes")
    with FaultProxy(seaweed.endpoint) as proxy:
        proxy.plan = lambda method, path, n: "503" if method == "PUT" else "pass"
        b = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname))
        _read_all(b, new)  # from the origin; their publishes and leases are refused
        refused = ('cachefs_shared_publishes_total{result="failed"}',
                   'cachefs_shared_publishes_total{result="dropped_unavailable"}')
        _wait(lambda: sum(b.metric(r) for r in refused) >= 3
              and b.metric("cachefs_shared_publish_queue_blocks") == 0, what="refused publishes")
        gets = b.gets()
        assert gets > 0
        _read_all(b, old)  # from the tier
        assert b.gets() == gets, b.log()
        assert b.metric('cachefs_shared_lookups_total{result="skipped"}') == 0
        assert b.metric("cachefs_shared_breaker_opens_total") == 0
        assert b.log().count("throttles writes") == 1, b.log()
        assert _fuse_errors(b) == 0


def test_warm_shard_replaces_a_tier_block_cut_short_under_its_stamp(
        bucket, tier, seaweed, mount_factory):
    """A block object cut short that kept its metadata (the stamp names the block and its
    full length) is not "in the tier" for a warm: the warm puts the whole block back."""
    _, name = bucket
    tclient, tname = tier
    node, data, blocks = _node_warmed_into_the_tier(bucket, tier, seaweed, mount_factory, 4, 8)
    objects = _tier_objects(tclient, tname)
    assert len(objects) == blocks
    key = sorted(objects)[0]
    got = tclient.get_object(Bucket=tname, Key=key)
    body, meta = got["Body"].read(), got["Metadata"]
    assert len(body) == BS and meta
    tclient.put_object(Bucket=tname, Key=key, Body=body[:BS // 2], Metadata=meta)

    again = run_cachefs("warm", str(node.path), "--shard", "0/1")
    assert again.returncode == 0, again.stderr
    assert tclient.get_object(Bucket=tname, Key=key)["Body"].read() == body
    other = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(other, data)
    assert other.gets() == 0
    assert other.metric('cachefs_shared_lookups_total{result="corrupt"}') == 0


def test_a_node_killed_holding_fetch_leases_costs_the_others_one_wait(
        bucket, tier, seaweed, mount_factory):
    """A node SIGKILLed while it holds fetch leases (its origin GETs hung) never publishes
    those blocks: another node that misses them waits for the lease (lost), then fetches
    each itself once, serves every byte and publishes; a third reads them from the tier."""
    from tests.test_crash import kill_daemon

    client, name = bucket
    tclient, tname = tier
    big = random.Random(21).randbytes(4 * BS)
    client.put_object(Bucket=name, Key="big.bin", Body=big)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname), start=False)
    with FaultProxy(a.endpoint) as proxy:
        a.endpoint = proxy.url
        a.start()
        assert (a.path / "big.bin").stat().st_size == len(big)
        proxy.plan = lambda method, path, n: ("stall" if method == "GET" and "big.bin" in path
                                              else "pass")
        errors: list[BaseException] = []

        def read() -> None:
            try:
                (a.path / "big.bin").read_bytes()
            except OSError as exc:  # its daemon is killed mid-read
                errors.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def leases() -> list[str]:
            out = tclient.list_objects_v2(Bucket=tname, Prefix="cache/leases/")
            return [o["Key"] for o in out.get("Contents", []) if "probe" not in o["Key"]]

        _wait(lambda: len(leases()) >= 1 and proxy.faults["stall"] >= 1, what="a held lease")
        held = len(leases())
        kill_daemon(a.path)
        reader.join(30)
        assert not reader.is_alive()
        b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
        assert (b.path / "big.bin").read_bytes() == big
        assert b.gets() == 4  # each block once, those of the dead node's leases too
        lost = b.metric('cachefs_shared_leases_total{result="lost_timeout"}')
        assert lost == held - b.metric('cachefs_shared_leases_total{result="raced"}'), b.log()
        _wait(lambda: b.metric("cachefs_shared_publish_queue_blocks") == 0, what="publishes")
        c = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
        assert (c.path / "big.bin").read_bytes() == big
        assert c.gets() == 0


def test_the_tier_bucket_deleted_while_nodes_read(bucket, tier, seaweed, mount_factory):
    """The tier's bucket deleted under a running cluster: every read is served, from the
    origin, with every byte right; 'cachefs status' says the tier fails."""
    client, name = bucket
    tclient, tname = tier
    data = _dataset(client, name, files=6, seed=31)
    names = sorted(data)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    for key in names[:2]:
        assert (a.path / key).read_bytes() == data[key]
    _wait(lambda: a.metric("cachefs_shared_publish_queue_blocks") == 0
          and _published(a) > 0, what="publishes")
    for page in tclient.get_paginator("list_objects_v2").paginate(Bucket=tname):
        for o in page.get("Contents", []):
            tclient.delete_object(Bucket=tname, Key=o["Key"])
    tclient.delete_bucket(Bucket=tname)
    for key in names:
        assert (b.path / key).read_bytes() == data[key]
    assert _fuse_errors(b) == 0

    def shared() -> dict[str, Any]:  # (the status snapshot is refreshed every second)
        status = json.loads(run_cachefs("status", "--json", str(b.path)).stdout)
        return status["shared"] if "shared" in status else status["mounts"][0]["shared"]

    _wait(lambda: shared()["lookups"]["error"] > 0, what="status")
    got = shared()
    assert got["breaker"] != "closed" or not got["publishing"], got
    assert b.gets() == _blocks(data)  # each block once, from the origin
    text = run_cachefs("status", str(b.path)).stdout
    assert "breaker open" in text or "publishing off" in text, text
    # ... and why, with the tier's answer: an operator sees the bucket is gone.
    assert "does not exist" in text or "access denied" in text, text


@pytest.mark.slow
def test_the_tier_bucket_made_again_takes_blocks_again_soon(bucket, tier, seaweed,
                                                           mount_factory):
    """The tier's bucket deleted and made again under a running node: its writes had
    been refused (SeaweedFS answers a PUT to a missing bucket 403) and publishing stayed
    off for 5 minutes, long after the bucket was back and its lookups answered. Once the
    tier answers again, the node publishes again (here within a minute; blocks read from
    the origin one at a time, at random offsets of one large file, so each is a fetch of
    its own)."""
    import os

    client, name = bucket
    tclient, tname = tier
    blocks = 512
    body = random.Random(7).randbytes(blocks * BS)
    client.put_object(Bucket=name, Key="big/x.bin", Body=body)
    b = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname,
                                                    "--read-ahead", "64K"))
    order = list(range(blocks))
    random.Random(8).shuffle(order)
    fd = os.open(b.path / "big" / "x.bin", os.O_RDONLY)

    def shared() -> dict[str, Any]:
        return json.loads(run_cachefs("status", "--json", str(b.path)).stdout)["shared"]

    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

        def read_next() -> None:
            i = order.pop()
            assert os.pread(fd, 100, i * BS + 7) == body[i * BS + 7:i * BS + 107]

        for _ in range(3):
            read_next()
        _wait(lambda: _published(b) >= 3, what="the first publishes")
        for page in tclient.get_paginator("list_objects_v2").paginate(Bucket=tname):
            for o in page.get("Contents", []):
                tclient.delete_object(Bucket=tname, Key=o["Key"])
        tclient.delete_bucket(Bucket=tname)
        deadline = time.monotonic() + 30
        while True:  # (until a write is refused and lookups fail)
            read_next()
            st = shared()
            if (not st["publishing"] and st["breaker"] != "closed") or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not st["publishing"] and ("refuses writes" in st["why"]
                                         or "does not answer" in st["why"]), st
        tclient.create_bucket(Bucket=tname)
        made_again = time.monotonic()
        while not _tier_objects(tclient, tname):
            assert time.monotonic() - made_again < 60, (
                f"nothing published {time.monotonic() - made_again:.0f}s after the bucket "
                f"was made again: {shared()}")
            read_next()
            time.sleep(0.2)
    finally:
        os.close(fd)
    assert _fuse_errors(b) == 0


def test_warm_against_a_tier_that_is_down(bucket, tier, seaweed, mount_factory):
    """A tier down during warms: a plain warm loads every file from the origin and
    succeeds; a shard's warm loads its share, says the tier did not take it and exits
    non-zero; run again once the tier is back, it publishes the share without fetching
    it again."""
    client, name = bucket
    tclient, tname = tier
    data = _dataset(client, name, files=6, seed=41)
    blocks = _blocks(data)
    with FaultProxy(seaweed.endpoint) as proxy:
        plain = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname,
                                                            "--shared-cache-timeout", "2s"))
        node = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname,
                                                           "--shared-cache-timeout", "2s"))
        proxy.set_down(True)
        r = run_cachefs("warm", str(plain.path))
        assert r.returncode == 0, r.stderr
        r = run_cachefs("warm", str(plain.path), "--check")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        _read_all(plain, data)
        assert plain.gets() == blocks

        r = run_cachefs("warm", str(node.path), "--shard", "0/1")
        assert r.returncode != 0, r.stdout
        assert "shared cache tier" in r.stdout + r.stderr and "Traceback" not in r.stderr
        # Each failure says why: the tier does not answer (not: "could not be put", alone).
        out = r.stdout + r.stderr
        failures = [line for line in out.splitlines() if line.startswith("failed:")]
        assert failures and all("does not answer" in line for line in failures), out
        assert node.gets() == blocks
        proxy.set_down(False)
        deadline = time.monotonic() + 60
        while True:  # (the breaker lets a trial through after its cooldown)
            r = run_cachefs("warm", str(node.path), "--shard", "0/1")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.returncode == 0, r.stdout + r.stderr
        assert node.gets() == blocks
        assert len(_tier_objects(tclient, tname)) == blocks


def test_two_clusters_with_other_block_sizes_share_one_tier_prefix(
        bucket, tier, seaweed, mount_factory):
    """Clusters of 64 KiB and 128 KiB blocks on one tier bucket and prefix never read each
    other's blocks as theirs: each fills its own, and a second node of each reads its
    cluster's from the tier, every byte right."""
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=6, seed=51)
    small = _shared_args(seaweed.endpoint, tname)
    large = [*small, "--block-size", "128K"]
    a64 = mount_factory(f"s3://{name}", *small)
    _read_all(a64, data)
    _wait(lambda: a64.metric("cachefs_shared_publish_queue_blocks") == 0, what="publishes")
    a128 = mount_factory(f"s3://{name}", *large)
    _read_all(a128, data)
    assert a128.gets() > 0  # nothing of the other cluster's was taken as its own
    assert a128.metric('cachefs_shared_lookups_total{result="hit"}') == 0
    _wait(lambda: a128.metric("cachefs_shared_publish_queue_blocks") == 0, what="publishes")
    for args in (small, large):
        node = mount_factory(f"s3://{name}", *args)
        _read_all(node, data)
        assert node.gets() == 0
        bad = ('cachefs_shared_lookups_total{result="corrupt"}',
               'cachefs_shared_lookups_total{result="foreign"}')
        assert sum(node.metric(r) for r in bad) == 0


def test_warm_shard_waits_out_a_tier_throttling_its_writes(bucket, tier, seaweed,
                                                           mount_factory):
    """Every node of a cluster warm publishing at once is what makes a tier answer 503
    SlowDown: a shard's warm waits the throttle out and puts its whole share there, instead
    of failing the files whose blocks met it."""
    client, name = bucket
    tclient, tname = tier
    data = _dataset(client, name, files=6, seed=61)
    blocks = _blocks(data)
    with FaultProxy(seaweed.endpoint) as proxy:
        node = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname))
        refused = threading.Semaphore(8)  # the first 8 block writes are throttled

        def plan(method: str, path: str, n: int) -> str:
            if method == "PUT" and "/v1/" in path and refused.acquire(blocking=False):
                return "503"
            return "pass"

        proxy.plan = plan
        r = run_cachefs("warm", str(node.path), "--shard", "0/1")
        assert proxy.faults["503"] >= 3
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(_tier_objects(tclient, tname)) == blocks
        assert node.gets() == blocks


def test_the_tier_restarted_between_reads_costs_no_lookup(bucket, tier, seaweed,
                                                          mount_factory):
    """The tier's server stopped and started again while a node was idle (or it closed
    idle keep-alive connections, as servers do): the node's next lookups find their pooled
    connections dead. They are sent again on new ones: every block still comes from the
    tier, none from the origin, and the breaker stays closed."""
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=12, seed=71)
    names = sorted(data)
    keys = [names[i] for i in (0, 6, 3, 9, 1, 7, 4, 10, 2, 8, 5, 11)]  # (no lookahead)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname))
    _read_all(a, data)
    _wait(lambda: _published(a) >= _blocks(data)
          and a.metric("cachefs_shared_publish_queue_blocks") == 0, what="publishes")
    with FaultProxy(seaweed.endpoint) as proxy:
        b = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname))
        for key in keys[:6]:
            assert (b.path / key).read_bytes() == data[key]
        assert b.gets() == 0
        proxy.set_down(True)  # the pooled connections are reset
        proxy.set_down(False)
        for key in keys[6:]:
            assert (b.path / key).read_bytes() == data[key]
        assert b.gets() == 0, b.log()
        assert b.metric('cachefs_shared_lookups_total{result="error"}') == 0
        assert b.metric("cachefs_shared_breaker_opens_total") == 0


def _in_host_named(name: str) -> Any:
    """A preexec_fn: the mount command (and the daemon it starts) in a UTS namespace of
    its own whose host name is ``name`` (a pod's, without hostNetwork)."""
    import ctypes
    import os
    import socket

    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
        socket.sethostname(name)
        os.environ.pop("HOSTNAME", None)
    return enter


@pytest.mark.parametrize("replaced", [False, True], ids=["restarted", "pod-replaced"])
def test_a_node_restarted_after_a_kill_takes_over_its_own_fetch_leases(
        bucket, tier, seaweed, mount_factory, monkeypatch, replaced):
    """A node SIGKILLed while it holds fetch leases (its origin GETs hung) and restarted on
    the same cache directory is the same node: its leases are its own (taken over at once,
    ``reclaimed``), not another node's to wait for (``lost_timeout``, a ``lease_wait``
    per block for up to the lease window). Every byte is served and each block is fetched
    once. ``pod-replaced``: the daemon started again in a new pod of a DaemonSet without
    hostNetwork, whose host name (the pod's) is another, with the node's name given from
    the downward API (CACHEFS_NODE_NAME, as deploy/kubernetes sets it): it waited for its
    own leases, as another node's, before the node's name was used."""
    from tests.test_crash import kill_daemon

    client, name = bucket
    tclient, tname = tier
    big = random.Random(29).randbytes(4 * BS)
    client.put_object(Bucket=name, Key="big.bin", Body=big)
    a = mount_factory(f"s3://{name}", *_shared_args(seaweed.endpoint, tname), start=False)
    if replaced:
        monkeypatch.setenv("CACHEFS_NODE_NAME", "ip-10-0-1-17.ec2.internal")
        a.preexec_fn = _in_host_named("cachefs-x7k2p")

    def leases() -> list[str]:
        out = tclient.list_objects_v2(Bucket=tname, Prefix="cache/leases/")
        return [o["Key"] for o in out.get("Contents", []) if "probe" not in o["Key"]]

    with FaultProxy(a.endpoint) as proxy:
        a.endpoint = proxy.url
        a.start()
        assert (a.path / "big.bin").stat().st_size == len(big)
        proxy.plan = lambda method, path, n: ("stall" if method == "GET" and "big.bin" in path
                                              else "pass")
        reader = threading.Thread(target=_read_quietly, args=(a.path / "big.bin",),
                                  daemon=True)
        reader.start()
        _wait(lambda: len(leases()) >= 1 and proxy.faults["stall"] >= 1, what="a held lease")
        kill_daemon(a.path)
        reader.join(30)
        assert not reader.is_alive()
        held = leases()
        window = int(time.time() // 600)
        proxy.plan = lambda method, path, n: "pass"
        if replaced:
            a.preexec_fn = _in_host_named("cachefs-q9w4m")
        a.start()  # the same cache directory: the same node
        assert (a.path / "big.bin").read_bytes() == big
        turned_over = int(time.time() // 600) != window or any(
            not k.endswith(f".{window}") for k in held)

        def count(result: str) -> float:
            return a.metric(f'cachefs_shared_leases_total{{result="{result}"}}')

        assert count("lost_timeout") == 0 and count("lost_served") == 0, a.log()
        assert count("raced") == 0 and count("error") == 0
        if not turned_over:  # (a lease window turning over makes them new leases)
            assert count("reclaimed") == len(held), a.log()
        assert count("won") + count("reclaimed") == 4
        assert a.gets() == 4
        if replaced:
            _wait(lambda: "this node's leases hold ip-10-0-1-17.ec2.internal:" in a.log(),
                  what="the start-up check's line")


def _read_quietly(path: Path) -> None:
    try:
        path.read_bytes()
    except OSError:  # its daemon is killed mid-read
        pass


@pytest.mark.parametrize("honours", [True, False], ids=["honours", "ignores"])
def test_the_tier_checked_again_once_it_answers_after_a_start_without_it(
        bucket, tier, seaweed, mount_factory, honours):
    """A node mounted while its tier did not answer checks the tier (access, and whether it
    honours If-None-Match, which fetch leases need) once the tier answers: 'cachefs status'
    says so, and on a store that ignores the header fetch leases go off (one log line)
    instead of every miss writing a lease that always 'wins'."""
    client, name = bucket
    _, tname = tier
    data = _dataset(client, name, files=6, seed=83)
    with FaultProxy(seaweed.endpoint) as proxy:
        proxy.set_down(True)
        if not honours:
            proxy.plan = lambda method, path, n: "no412"
        m = mount_factory(f"s3://{name}", *_shared_args(proxy.url, tname),
                          "--shared-cache-timeout", "2s")
        _wait(lambda: "start-up check failed" in m.log(), what="the failed start-up check")

        def shared() -> dict[str, Any]:
            r = run_cachefs("status", str(m.path), "--json")
            assert r.returncode == 0, r.stderr
            return dict(json.loads(r.stdout)["shared"])

        assert shared()["conditional_writes"] is None
        proxy.set_down(False)
        names = sorted(data)
        i = 0

        def checked() -> bool:
            nonlocal i
            if i < len(names):  # reads are what a node does; the tier answers them
                assert (m.path / names[i]).read_bytes() == data[names[i]]
                i += 1
            return shared()["conditional_writes"] is not None

        _wait(checked, timeout=60, what="the tier checked again")
        state = shared()
        assert state["conditional_writes"] is honours and state["leases"] is honours, state
        for key in names:
            assert (m.path / key).read_bytes() == data[key]
        log = m.log()
        assert log.count("ignores If-None-Match") == (0 if honours else 1), log
        if honours:
            assert "ready (conditional writes honoured, fetch leases on)" in log
