"""The CUDA caching allocator, replayed: what a step's allocations *reserve* on the device.

A plan must fit what the allocator reserves, not only what tensors occupy: freed blocks stay
cached in their segments, and a request that no cached block fits opens a new segment while
the cached ones sit idle (fragmentation). Measured on an H200: a step estimated at 23.86 GiB
reached 23.34 GiB allocated and 23.56 GiB reserved under a 24 GiB cap and ran out of memory;
plain fp32 GPT-2 at micro-batch 6 held 10.96 GiB allocated and 12.40 GiB reserved.

:func:`replay` runs the allocator's algorithm (``c10/cuda/CUDACachingAllocator.cpp``, default
settings) over the allocations and frees of an estimate, in order:

- requests are rounded up to 512 bytes; up to 1 MiB they come from the small pool (2 MiB
  segments), above from the large pool (20 MiB segments below 10 MiB, else their own segment
  rounded up to 2 MiB);
- the smallest cached block that fits is taken (ties: the lowest address) and split when the
  rest is at least 512 bytes (small pool) or more than 1 MiB (large pool); a freed block merges
  with free neighbours of its segment;
- when no cached block fits, a segment is allocated; under a cap (``set_per_process_memory_
  fraction``) a segment that would pass it first makes the allocator free every cached segment
  with nothing allocated in it, then it tries again, and then it is out of memory.

The result: peak allocated and peak reserved bytes, and whether the steps ran out of memory
under the cap. All on one stream (the training step's).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AllocatorReplay", "replay", "round_request"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # requests up to this come from the small pool
SMALL_BUFFER = 2 << 20  # a small-pool segment
LARGE_BUFFER = 20 << 20  # a large-pool segment for requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_request(nbytes: int) -> int:
    """The allocator's block size for a request of ``nbytes`` (512-byte multiples)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def _segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass
class AllocatorReplay:
    """What :func:`replay` found.

    Attributes:
        allocated_peak: Peak bytes in blocks handed out (``max_memory_allocated``).
        reserved_peak: Peak bytes in segments (``max_memory_reserved``).
        out_of_memory: A request could not be met under the cap.
        segments: Segments allocated over the replay.
    """

    allocated_peak: int = 0
    reserved_peak: int = 0
    out_of_memory: bool = False
    segments: int = 0


class _Allocator:
    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self.reserved = self.allocated = 0
        self.next_address = 0
        self.segments: dict[int, int] = {}  # segment id -> size
        self.result = AllocatorReplay()

    # pools of free blocks, ordered by (size, address)
    def _insert(self, block: _Block) -> None:
        bisect.insort(self.pools[block.small], (*block.key(), block))

    def _remove(self, block: _Block) -> None:
        pool = self.pools[block.small]
        i = bisect.bisect_left(pool, block.key(), key=lambda e: (e[0], e[1]))
        del pool[i]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1), key=lambda e: (e[0], e[1]))
        return pool[i][2] if i < len(pool) else None

    def _new_segment(self, size: int, small: bool) -> _Block | None:
        seg = _segment_size(size)
        if self.cap is not None and self.reserved + seg > self.cap:
            return None
        self.reserved += seg
        self.result.reserved_peak = max(self.result.reserved_peak, self.reserved)
        # numbered by how many were opened (not how many are held: a released segment's number
        # is never handed out again)
        block = _Block(self.next_address, seg, self.result.segments, small)
        self.segments[block.segment] = seg
        self.result.segments += 1
        self.next_address += seg
        return block

    def _release_cached(self) -> None:
        """Free every cached segment that has nothing allocated (``release_cached_blocks``)."""
        for small in (True, False):
            for _, _, block in list(self.pools[small]):
                if block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved -= block.size
                    del self.segments[block.segment]

    def malloc(self, nbytes: int) -> _Block | None:
        size = round_request(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is not None:
            self._remove(block)
        else:
            block = self._new_segment(size, small)
            if block is None:
                self._release_cached()
                block = self._new_segment(size, small)
            if block is None:
                self.result.out_of_memory = True
                return None
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.address + size, rest, block.segment, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.free = False
        self.allocated += block.size
        self.result.allocated_peak = max(self.result.allocated_peak, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)


def replay(events: Iterable[tuple[object, int, int]], cap: int | None = None) -> AllocatorReplay:
    """Replay ``events`` (``(key, +1 or -1, requested bytes)`` in order; a free names the key
    of its allocation) through the caching allocator, optionally under a ``cap`` in bytes.
    Stops at the first request that runs out of memory."""
    allocator = _Allocator(cap)
    live: dict[object, _Block] = {}
    for key, sign, nbytes in events:
        if sign > 0:
            if nbytes <= 0:
                continue
            block = allocator.malloc(nbytes)
            if block is None:
                break
            live[key] = block
        else:
            block = live.pop(key, None)
            if block is not None:
                allocator.free(block)
    return allocator.result
