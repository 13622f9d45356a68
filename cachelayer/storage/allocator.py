"""A free-list allocator over one byte range: best fit, split on allocate, coalesce on free.

It hands out offsets into the L1 pool, so storing a chunk costs bookkeeping, never a malloc.
Sizes may vary (compressed chunks are smaller than raw ones); every request is rounded up to
ALIGNMENT so that any dtype view of an allocation is aligned.
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList

from cachelayer.errors import CacheLayerError

ALIGNMENT = 512


class DoubleFreeError(CacheLayerError, RuntimeError):
    """An offset was freed that is not currently allocated."""


class FreeListAllocator:
    """Offsets in [0, capacity). Not thread-safe: the owner serializes calls."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGNMENT
        self._free_by_offset: SortedDict = SortedDict()  # offset -> size
        self._free_by_size: SortedList = SortedList()  # (size, offset)
        self._allocated: dict[int, int] = {}  # offset -> size
        self.allocated_bytes = 0
        if self.capacity > 0:
            self._add_free(0, self.capacity)

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a fresh region of at least nbytes, or None if no free region is big enough."""
        size = self.rounded(nbytes)
        index = self._free_by_size.bisect_left((size, -1))
        if index == len(self._free_by_size):
            return None
        free_size, offset = self._free_by_size[index]
        self._remove_free(offset, free_size)
        if free_size > size:
            self._add_free(offset + size, free_size - size)
        self._allocated[offset] = size
        self.allocated_bytes += size
        return offset

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise DoubleFreeError(f"offset {offset} is not allocated (double free or foreign offset)")
        self.allocated_bytes -= size
        # Merge with the free neighbours so that large chunks fit again after small ones leave.
        index = self._free_by_offset.bisect_left(offset)
        if index > 0:
            before_offset, before_size = self._free_by_offset.peekitem(index - 1)
            if before_offset + before_size == offset:
                self._remove_free(before_offset, before_size)
                offset, size = before_offset, before_size + size
        after_size = self._free_by_offset.get(offset + size)
        if after_size is not None:
            self._remove_free(offset + size, after_size)
            size += after_size
        self._add_free(offset, size)

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    @property
    def largest_free(self) -> int:
        return self._free_by_size[-1][0] if self._free_by_size else 0

    def _add_free(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_by_size.add((size, offset))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free_by_offset[offset]
        self._free_by_size.remove((size, offset))
