"""Unit tests of cachefs.read.hints.ReadOrder's bounds: GETs in flight and listings asked ahead.

Over MemoryStore + BlockCache + Fetcher + Prefetcher (no FUSE), with a store that holds
every GET until the test lets it go, so what is in flight can be counted.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from cachefs.cache.index import Entry
from cachefs.read import hints
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.hints import PREPARE_AHEAD, ReadOrder
from cachefs.read.prefetcher import HINT
from cachefs.s3.memory import MemoryStore
from tests.test_sweep import World, run


def _entry(obj: ObjectVersion) -> Entry:
    """A listing's entry of ``obj``."""
    return Entry(obj.key.rsplit("/", 1)[1].encode(), False, obj.size, 0.0, obj.etag)


class GatedStore(MemoryStore):
    """GETs wait (in their worker thread) until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        return super().get(*args, **kwargs)


def test_hinted_loads_in_flight_stay_within_the_window_and_listings_go_first(
        tmp_path: Path) -> None:
    prepared: list[str] = []

    async def body(w: World) -> None:
        keys = [k for c in range(30) for k in w.make_dir(f"train/c{c:03d}/", 10)]
        order = keys[::-1]

        async def resolve(key: str) -> Entry | None:
            assert key[:key.rfind("/") + 1] in prepared, "resolved before its listing was asked"
            return _entry(w.files[key][0])

        ro = ReadOrder(w.prefetcher, resolve, lookahead_bytes=1 << 30, window=6,
                       prepare=prepared.append)
        ro.set_order(order)
        await ro._top_up()
        assert w.prefetcher.loading(HINT) == 6, "the window bounds the loads started"
        ahead = {k[:k.rfind("/") + 1] for k in order[:PREPARE_AHEAD * 6]}
        assert set(prepared) == ahead and len(prepared) == len(ahead), "each directory once"
        await ro._top_up()
        assert w.prefetcher.loading(HINT) == 6
        assert isinstance(w.store, GatedStore)
        w.store.gate.set()
        await w.fetcher.drain()
        assert w.prefetcher.loading(HINT) == 0
        await ro._top_up()
        assert w.prefetcher.loading(HINT) == 6, "the window is refilled as loads end"
        await w.fetcher.drain()

    run(tmp_path, body, store=GatedStore())


def test_opens_move_the_cursor_on_any_thread_and_wake_the_loop_only_when_it_waits_for_them(
        tmp_path: Path) -> None:
    async def body(w: World) -> None:
        keys = [k for c in range(4) for k in w.make_dir(f"train/c{c:03d}/", 10)]
        order = keys[::-1]

        async def resolve(key: str) -> Entry | None:
            return _entry(w.files[key][0])

        size = w.files[order[0]][0].size
        # The byte bound: three files ahead of the cursor.
        ro = ReadOrder(w.prefetcher, resolve, lookahead_bytes=3 * size, window=100)
        ro.set_order(order)
        await ro._top_up()
        assert w.prefetcher.loading(HINT) == 3, "the byte bound stops the loop"
        # A worker's open moves the cursor and asks for a wake-up: the loop waits for it.
        moved: list[bool] = []
        t = threading.Thread(target=lambda: moved.append(ro.opened(order[1])))
        t.start()
        t.join(10)
        assert moved == [True] and ro._cursor == 1
        assert not ro.opened(order[0]), "a file behind the cursor does not move it"
        await ro._top_up()
        assert w.prefetcher.loading(HINT) == 5, "the files up to 3 past the cursor"
        # A full window: opens move the cursor without a hand-over to the trio thread.
        ro.window, ro.lookahead_bytes = 5, 100 * size
        await ro._top_up()
        assert not ro.opened(order[2]) and ro._cursor == 2
        # A new order: an open of a file only the old order had moves nothing.
        ro.set_order(order[:5])
        assert not ro.opened(order[20]) and ro._cursor == -1
        assert isinstance(w.store, GatedStore)
        w.store.gate.set()
        await w.fetcher.drain()

    run(tmp_path, body, store=GatedStore())


def test_the_end_of_a_hinted_load_tops_the_window_up_without_a_timer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hints, "TICK", 3600.0)  # only a load's end may wake the loop

    async def body(w: World) -> None:
        keys = [k for c in range(3) for k in w.make_dir(f"train/c{c:03d}/", 10)]

        async def resolve(key: str) -> Entry | None:
            return _entry(w.files[key][0])

        ro = ReadOrder(w.prefetcher, resolve, lookahead_bytes=1 << 30, window=4)
        async with trio.open_nursery() as nursery:
            await nursery.start(ro.run)
            ro.set_order(keys)
            with trio.fail_after(10):
                while w.prefetcher.loading(HINT) < 4:
                    await trio.sleep(0.01)
                assert isinstance(w.store, GatedStore)
                w.store.gate.set()  # every GET answers; no reader opens anything
                while ro.pending:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        await w.fetcher.drain()
        assert w.prefetcher.loading(HINT) == 0
        assert all(w.fetcher.is_cached(obj, 0) for obj, _ in w.files.values())

    run(tmp_path, body, store=GatedStore())
