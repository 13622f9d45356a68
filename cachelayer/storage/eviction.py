"""Eviction orders: which chunk leaves first when a tier is full (LRU, LFU, FIFO).

A policy only orders keys; the tier decides whether a candidate may leave (pinned or in-use
chunks never do) and walks the candidates until enough space is free.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from sortedcontainers import SortedList


class EvictionPolicy(Protocol):
    def on_insert(self, key: int) -> None: ...
    def on_access(self, key: int) -> None: ...
    def on_remove(self, key: int) -> None: ...
    def in_order(self) -> Iterator[int]:
        """Keys in the order they should leave, lazily (no snapshot: the caller must not change the
        policy while iterating; cheap when only the first few keys are wanted)."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, key: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: int) -> None:
        self._order.pop(key, None)

    def in_order(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First stored first; reads do not refresh a chunk."""

    def on_access(self, key: int) -> None:
        pass


class LFUPolicy:
    """Least frequently used first; ties go to the least recently used."""

    def __init__(self) -> None:
        self._clock = itertools.count()
        self._rank: dict[int, tuple[int, int]] = {}  # key -> (uses, last use tick)
        self._order: SortedList = SortedList()  # (uses, tick, key)

    def on_insert(self, key: int) -> None:
        self.on_remove(key)
        rank = (1, next(self._clock))
        self._rank[key] = rank
        self._order.add((*rank, key))

    def on_access(self, key: int) -> None:
        rank = self._rank.get(key)
        if rank is None:
            return
        self._order.remove((*rank, key))
        rank = (rank[0] + 1, next(self._clock))
        self._rank[key] = rank
        self._order.add((*rank, key))

    def on_remove(self, key: int) -> None:
        rank = self._rank.pop(key, None)
        if rank is not None:
            self._order.remove((*rank, key))

    def in_order(self) -> Iterator[int]:
        return (key for _, _, key in self._order)

    def __len__(self) -> int:
        return len(self._rank)


def make_policy(name: str) -> EvictionPolicy:
    policies = {"LRU": LRUPolicy, "LFU": LFUPolicy, "FIFO": FIFOPolicy}
    if name not in policies:
        raise ValueError(f"unknown cache_policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]()
