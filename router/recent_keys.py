"""A bounded set of the keys seen lately, in two generations (for membership on a hot path)."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable


class RecentKeys:
    """Keys added lately: between max_keys / 2 and max_keys of the latest. New keys go to the newer
    of two sets; when it holds max_keys / 2 it replaces the older one, which is dropped whole (a
    set update per batch, where an LRU moved a linked-list node per key). Thread-safe."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._newer: set[Hashable] = set()
        self._older: set[Hashable] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._newer or key in self._older

    def add(self, keys: Iterable[Hashable]) -> None:
        with self._lock:
            self._newer.update(keys)
            self._rotate_if_full()

    def seen_before(self, key: Hashable) -> bool:
        """Whether `key` was added lately; adds it."""
        with self._lock:
            if key in self._newer or key in self._older:
                return True
            self._newer.add(key)
            self._rotate_if_full()
            return False

    def _rotate_if_full(self) -> None:
        if len(self._newer) >= self.max_keys // 2:
            self._older, self._newer = self._newer, set()
