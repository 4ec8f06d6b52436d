"""Unit tests of cachefs.read.budget.MemoryBudget: reservations, waiters, the in-flight gauge."""

from __future__ import annotations

import trio
import trio.testing

from cachefs import metrics
from cachefs.read.budget import MemoryBudget


def inflight() -> float | None:
    return metrics.REGISTRY.get_sample_value("cachefs_inflight_bytes")


def test_the_gauge_reads_what_is_reserved_when_collected() -> None:
    budget = MemoryBudget(1000)
    assert budget.try_reserve(600) and inflight() == 600
    assert not budget.try_reserve(500) and inflight() == 600  # does not fit: nothing taken
    budget.force_reserve(700)
    assert budget.used == 1300 and inflight() == 1300  # demand reads overdraw
    budget.release(600)
    budget.release(700)
    assert budget.used == 0 and inflight() == 0


def test_a_waiting_reservation_is_woken_by_each_release_until_it_fits() -> None:
    async def main() -> None:
        budget = MemoryBudget(1000)
        assert budget.try_reserve(900)
        got: list[int] = []

        async def waiter() -> None:
            await budget.reserve(500)
            got.append(budget.used)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            budget.release(300)  # 600 used: 500 more does not fit yet
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            budget.release(300)  # 300 used: it fits
        assert got == [800] and inflight() == 800
        budget.release(800)
        assert budget.try_reserve(1000)  # nothing left over from the waiter

    trio.run(main)
