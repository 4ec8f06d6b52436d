"""Unit tests of cachefs.read.sequential.ReadStream (pure logic: which blocks to fetch ahead)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.read.sequential import BACKWARD_TOLERANCE, FORWARD_TOLERANCE, RANDOM_RUN, ReadStream

MiB = 1 << 20
BS = MiB


def stream(size: int = 1024 * MiB, max_window: int = 8 * MiB, initial: int | None = None) -> ReadStream:
    return ReadStream(size=size, block_size=BS, max_window=max_window, initial_window=initial)


def test_sequential_reads_grow_the_window_up_to_max() -> None:
    s = stream()
    got = []
    windows = []
    for i in range(7):
        got.append(list(s.on_read(i * BS, BS)))
        windows.append(s.window)
    assert windows == [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB]
    assert got == [
        [1],  # read block 0; window 1 block
        [2, 3],  # read block 1; window 2 blocks
        [3, 4, 5, 6],
        list(range(4, 12)),
        list(range(5, 13)),
        list(range(6, 14)),
        list(range(7, 15)),
    ]


def test_reads_within_one_block_do_not_grow_the_window() -> None:
    s = stream()
    assert list(s.on_read(0, 128 * 1024)) == [1]
    for k in range(1, 8):
        assert list(s.on_read(k * 128 * 1024, 128 * 1024)) == [1]
        assert s.window == BS
    # Crossing into block 1 doubles the window.
    assert list(s.on_read(BS, 128 * 1024)) == [2, 3]
    assert s.window == 2 * BS


def test_small_unaligned_sequential_reads() -> None:
    s = stream()
    offset = 0
    for _ in range(40):
        blocks = s.on_read(offset, 300_000)
        offset += 300_000
        assert s.window <= 8 * MiB
        if len(blocks):
            assert blocks[0] == -(-offset // BS)  # the first block after the data just read
            assert blocks[-1] == (offset + s.window - 1) // BS
    assert s.window == 8 * MiB


def test_random_read_returns_no_prefetch() -> None:
    s = stream()
    assert list(s.on_read(500 * MiB, BS)) == []
    assert s.window == 0
    assert list(s.on_read(17 * MiB + 12345, 4096)) == []  # far behind
    assert list(s.on_read(900 * MiB, 4096)) == []  # far ahead
    assert s.window == 0


def test_jump_resets_a_grown_window() -> None:
    s = stream()
    for i in range(5):
        s.on_read(i * BS, BS)
    assert s.window == 8 * MiB
    far = 5 * BS + FORWARD_TOLERANCE + BS
    assert list(s.on_read(far, BS)) == []
    assert s.window == 0
    # Reading on sequentially from there starts a new, small window.
    assert list(s.on_read(far + BS, BS)) == [far // BS + 2]
    assert s.window == BS


def test_backward_jump_beyond_tolerance_is_random() -> None:
    s = stream()
    for i in range(10):
        s.on_read(i * BS, BS)
    assert list(s.on_read(10 * BS - BACKWARD_TOLERANCE - 2 * BS, 4096)) == []
    assert s.window == 0


def test_small_backward_jitter_stays_sequential() -> None:
    s = stream()
    for i in range(4):
        s.on_read(i * BS, BS)
    window = s.window
    assert window == 8 * MiB
    # The kernel re-requests a little of what was just read (within the tolerance).
    back = 4 * BS - BACKWARD_TOLERANCE // 2
    blocks = s.on_read(back, BACKWARD_TOLERANCE // 2)
    assert len(blocks) > 0
    assert s.window == window
    assert list(s.on_read(4 * BS, BS)) == list(range(5, 13))


def test_restart_at_offset_zero_uses_initial_window() -> None:
    s = stream(initial=2 * MiB)
    assert list(s.on_read(0, 4096)) == [1, 2]  # bytes [4096, 4096 + 2 MiB) ahead
    s2 = stream(initial=2 * MiB)
    assert list(s2.on_read(0, BS)) == [1, 2]
    assert list(s.on_read(700 * MiB, 4096)) == []
    assert list(s.on_read(0, BS)) == [1, 2]  # a new pass over the file


def test_nothing_past_end_of_file() -> None:
    size = 5 * BS + 1000
    s = stream(size=size)
    for i in range(5):
        blocks = s.on_read(i * BS, BS)
        assert all(b <= 5 for b in blocks)
    assert list(s.on_read(4 * BS, BS)) == [5]
    assert list(s.on_read(5 * BS, BS)) == []  # reaches the end
    assert list(s.on_read(size, 4096)) == []  # at EOF
    assert list(s.on_read(size + 10 * BS, 4096)) == []  # past EOF


def test_small_file_read_whole_needs_no_prefetch() -> None:
    s = stream(size=300_000)
    assert list(s.on_read(0, 128 * 1024)) == []  # the only block is being read
    s = stream(size=3 * BS)
    assert list(s.on_read(0, 3 * BS)) == []


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(0, 64 * MiB),
    max_window=st.integers(BS, 16 * MiB),
    reads=st.lists(st.tuples(st.integers(0, 70 * MiB), st.integers(1, 4 * MiB)), min_size=1, max_size=30),
    sequential=st.booleans(),
)
def test_prefetch_is_always_ahead_bounded_and_inside_the_file(
        size: int, max_window: int, reads: list[tuple[int, int]], sequential: bool) -> None:
    s = ReadStream(size=size, block_size=BS, max_window=max_window)
    n_blocks = -(-size // BS)
    offset = 0
    for off, n in reads:
        if sequential:
            off, offset = offset, offset + n
        blocks = s.on_read(off, n)
        end = min(off + n, size)
        assert s.window <= max(BS, max_window)
        if len(blocks) == 0:
            continue
        assert blocks.step == 1
        assert blocks[0] == -(-end // BS)  # strictly after the data being read
        assert blocks[-1] < n_blocks  # never past EOF
        assert (blocks[-1] * BS) < end + s.window  # within the window


def test_a_short_run_from_a_random_offset_stays_random_and_opens_no_window() -> None:
    """A page fault of a memory map reads the kernel's read-around (1 MiB) as READs in
    order: random until the run has read more than RANDOM_RUN, then a sequential reader."""
    s = stream()
    start = 500 * MiB + 3 * 4096
    step = 128 * 1024
    for k in range(RANDOM_RUN // step):
        assert list(s.on_read(start + k * step, step)) == [], k
        assert s.random and s.window == 0, k
    k = RANDOM_RUN // step
    s.on_read(start + k * step, step)
    assert not s.random  # past RANDOM_RUN: in order
    while s.window == 0:  # opens at the next block entered
        k += 1
        assert k * step < 2 * BS, "no window within a block"
        s.on_read(start + k * step, step)
    # a run from offset 0 is never random
    s2 = stream()
    for k in range(4):
        s2.on_read(k * step, step)
        assert not s2.random


def test_a_run_that_skips_more_than_it_reads_stays_random() -> None:
    """Reads that each land within the forward tolerance of the one before but skip more
    than they read (page faults a few MiB apart) stay random past RANDOM_RUN: no window,
    pieces. A run whose READs arrive out of order but leave no hole (the kernel's
    readahead) is in order once past RANDOM_RUN."""
    s = stream()
    start = 500 * MiB + 4096
    for k in range(8):  # 1 MiB read, 3 MiB skipped, ...
        assert list(s.on_read(start + 4 * k * MiB, MiB)) == [], k
        assert s.random and s.window == 0, k
    s2 = stream()
    for k in (0, 2, 1, 4, 3, 5, 7, 6, 8, 9):  # 1 MiB READs, out of order, no hole left
        s2.on_read(start + k * MiB, MiB)
    assert not s2.random and s2.window > 0
