"""Which lookups give the native loop the next names of their directory ahead of time.

A walk's lookup (the next name after those remembered, or after the directory's
previous lookup answered in Python) remembers the names after it; a shuffled reader's
lookups, landing anywhere in a large directory, remember nothing more than their own
answer. The real mounts are in ``tests/test_passthrough.py``
(``test_a_cold_walk_is_looked_up_and_opened_without_python``)."""

from __future__ import annotations

import random
from typing import Any

from cachefs import fuse_ops
from cachefs.fs import Node
from cachefs.fuse_ops import LOOKUP_AHEAD, Operations

DIR_INO = 7
PREFIX = "d/"


def _node(ino: int) -> Node:
    name = f"f{ino:06d}".encode()
    return Node(ino, False, PREFIX + name.decode(), PREFIX, name, 100, 0.0, "e")


class _Dir:
    """A directory of ``n`` files numbered from 1000 in name order (the fs's part)."""

    def __init__(self, n: int) -> None:
        self.nodes = [_node(1000 + i) for i in range(n)]

    def siblings_now(self, prefix: str, name: bytes, n: int) -> list[Node]:
        assert prefix == PREFIX
        i = next(k for k, node in enumerate(self.nodes) if node.name == name)
        return self.nodes[i + 1:i + 1 + n]


class _Loop:
    def __init__(self) -> None:
        self.remembered: list[bytes] = []

    def remember_lookup(self, token: int, prefix: str, parent: int, name: bytes,
                        answer: bytes, fresh_for: float) -> bool:
        assert (token, prefix, parent, fresh_for) == (5, PREFIX, DIR_INO, 30.0)
        self.remembered.append(name)
        return True


def _ops(directory: _Dir) -> Operations:
    return Operations(directory, uid=0, gid=0, file_mode=0o444,  # type: ignore[arg-type]
                      dir_mode=0o555, attr_timeout=30.0, statfs_bytes=lambda: (0, 0))


def _lookups(ops: Operations, loop: Any, inos: list[int]) -> None:
    for ino in inos:
        ops._remember_ahead(loop, 5, PREFIX, DIR_INO, _node(ino), 30.0)  # type: ignore[arg-type]


def test_a_walk_remembers_the_names_after_its_lookups_once_it_is_a_walk() -> None:
    directory = _Dir(200)
    ops, loop = _ops(directory), _Loop()
    _lookups(ops, loop, [1000])  # one lookup: not a walk yet
    assert loop.remembered == []
    _lookups(ops, loop, [1001])  # the next name: the walk's next names are given ahead
    assert loop.remembered == [n.name for n in directory.nodes[2:2 + LOOKUP_AHEAD]]
    # The walk's lookups of those names are the loop's; the first one past them (a few
    # out of order: a pool of readers) goes on ahead again.
    _lookups(ops, loop, [1001 + LOOKUP_AHEAD + 3])
    assert len(loop.remembered) == 2 * LOOKUP_AHEAD
    assert loop.remembered[-1] == directory.nodes[4 + 2 * LOOKUP_AHEAD].name


def test_shuffled_lookups_of_a_large_directory_remember_almost_nothing_ahead() -> None:
    directory = _Dir(100_000)
    ops, loop = _ops(directory), _Loop()
    inos = [1000 + i for i in random.Random(3).sample(range(100_000), 300)]
    _lookups(ops, loop, inos)
    # A random next inode lands within the run's reach (about LOOKUP_AHEAD of 100,000
    # names) once in ~1,400 lookups: a few at most, not one per lookup.
    assert len(loop.remembered) <= 3 * LOOKUP_AHEAD


def test_the_walks_followed_are_bounded() -> None:
    ops, loop = _ops(_Dir(10)), _Loop()
    for parent in range(fuse_ops.LOOKUP_RUNS * 2):
        ops._remember_ahead(loop, 5, PREFIX, parent, _node(1000), 30.0)  # type: ignore[arg-type]
    assert len(ops._lookup_runs) <= fuse_ops.LOOKUP_RUNS
