"""Unit tests of cachefs.read.hints.ReadOrder's bounds: GETs in flight and listings asked ahead.

Over MemoryStore + BlockCache + Fetcher + Prefetcher (no FUSE), with a store that holds
every GET until the test lets it go, so what is in flight can be counted.
"""

from __future__ import annotations

import threading
from pathlib import Path

from cachefs.read.fetcher import ObjectVersion
from cachefs.read.hints import PREPARE_AHEAD, ReadOrder
from cachefs.read.prefetcher import HINT
from cachefs.s3.memory import MemoryStore
from tests.test_sweep import World, run


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

        async def resolve(key: str) -> ObjectVersion | None:
            assert key[:key.rfind("/") + 1] in prepared, "resolved before its listing was asked"
            return w.files[key][0]

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
