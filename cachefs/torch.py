"""Tell cachefs the order a PyTorch sampler will read files in (one line in a script).

::

    from cachefs.torch import hinted

    sampler = hinted(RandomSampler(dataset), paths=dataset.files)   # or DistributedSampler
    loader = DataLoader(dataset, sampler=sampler, num_workers=8, batch_size=256)

Every time the loader starts an epoch, the wrapped sampler draws its indices,
sends the corresponding file paths (in that order) to the cachefs daemon that
serves them, and yields the same indices. The daemon then fetches the files
ahead of the DataLoader workers, bounded by its memory budget, instead of one
file per worker at a time. With DistributedSampler each rank hints its own
share. If the paths are not on a cachefs mount, or the daemon cannot be
reached, training goes on unchanged (one warning). Only root and the user who
mounted cachefs may send hints (the control socket is private to them): a job
running as another user trains unhinted, with that warning.

``paths`` is a sequence (index -> path) or a callable taking an index. torch is
not imported by this module: any iterable of indices can be wrapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from cachefs.control.client import send_hint
from cachefs.errors import CachefsError

log = logging.getLogger(__name__)


class HintedSampler:
    """Wraps a sampler; before each epoch, hints its file order to cachefs."""

    def __init__(self, sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str],
                 *, max_hint: int | None = None) -> None:
        self.sampler = sampler
        self._path_of: Callable[[int], str] = paths if callable(paths) else paths.__getitem__
        self.max_hint = max_hint
        self.hints_sent = 0
        self._warned = False

    def __iter__(self) -> Iterator[int]:
        indices = list(iter(self.sampler))
        hint = indices if self.max_hint is None else indices[:self.max_hint]
        try:
            # A generator: the client sends the paths in chunks as it goes, so a hint of a
            # million files is never one huge request nor a second list of strings here.
            send_hint(str(self._path_of(i)) for i in hint)
            self.hints_sent += 1
        except (CachefsError, OSError) as exc:
            if not self._warned:
                log.warning("cachefs: read-order hint not sent (%s); reading without it", exc)
                self._warned = True
        return iter(indices)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to samplers that have it (DistributedSampler)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        # Only attributes this wrapper lacks reach here. Before __init__ has set the
        # sampler (copy and pickle make the object first and look up __setstate__ and
        # the like on it), asking self.sampler would come back here without end.
        sampler = self.__dict__.get("sampler")
        if sampler is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(sampler, name)


def hinted(sampler: Iterable[int], paths: Sequence[str] | Callable[[int], str],
           **kwargs: Any) -> HintedSampler:
    """``sampler`` that also tells cachefs its read order each epoch."""
    return HintedSampler(sampler, paths, **kwargs)
