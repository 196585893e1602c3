"""Host-side bookkeeping of an ad table: which slot holds which ad, the newest version of every ad seen,
free slots; and the plan of one batch of ops worked out on an overlay of it before anything is written."""
from __future__ import annotations

from andromeda_core.ops import DELETE, PAUSE, RESUME, UPSERT


class SlotBook:
    """Host-side bookkeeping of a table, read without touching the device: live ad -> slot, the newest
    version seen of every ad (live, or deleted / expired: a tombstone), free slots, high-water mark."""

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[int, int] = {}
        self.version: dict[int, int] = {}
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: lowest slot first
        self.high_water = 0  # slots >= high_water have never held an ad; scans stop there

    def tombstones(self) -> dict[int, int]:
        """ad_id -> the version that deleted or expired it."""
        return {ad: v for ad, v in self.version.items() if ad not in self.slot_of}


class SlotPlan:
    """One batch's effect, worked out on an overlay of a SlotBook that stays untouched until `commit`."""

    def __init__(self, book: SlotBook, capacity: int) -> None:
        self.book, self.capacity = book, capacity
        self.slot_of: dict[int, int | None] = {}  # ad -> slot after the batch, None when released
        self.version: dict[int, int] = {}  # ad -> newest version after the batch
        self.row_at: dict[int, int] = {}  # slot -> the batch row written there
        self.active: dict[int, bool] = {}  # slot -> ACTIVE bit set by a pause / resume after its row, if any
        self.ad_at: dict[int, int] = {}  # slot -> ad, for every slot whose status and version are rewritten
        self.freed: list[int] = []
        self.taken = 0  # new slots: from the end of the free list, then past the capacity

    @property
    def capacity_needed(self) -> int:
        return self.capacity + max(0, self.taken - len(self.book.free))

    def op(self, code: int, ad: int, version: int, row: int) -> bool:
        """Plan one op; False when it is a no-op (stale, or a pause / resume of an ad not indexed)."""
        slot = self.slot_of[ad] if ad in self.slot_of else self.book.slot_of.get(ad)
        if version <= self.version.get(ad, self.book.version.get(ad, -1)) or (slot is None and code in (PAUSE, RESUME)):
            return False
        if code == DELETE:
            if slot is not None:
                self.release(ad, slot, version)
            self.version[ad] = version  # kept when not indexed too: a late, older upsert must not resurrect it
            return True
        if code == UPSERT:
            slot = self._take() if slot is None else slot
            self.row_at[slot] = row
            self.active.pop(slot, None)
        else:
            self.active[slot] = code == RESUME
        self.slot_of[ad], self.ad_at[slot], self.version[ad] = slot, ad, version
        return True

    def release(self, ad: int, slot: int, version: int) -> None:
        self.slot_of[ad], self.version[ad] = None, version
        for pending in (self.row_at, self.active, self.ad_at):
            pending.pop(slot, None)
        self.freed.append(slot)

    def _take(self) -> int:
        i, free = self.taken, self.book.free
        self.taken += 1
        return free[-1 - i] if i < len(free) else self.capacity + i - len(free)

    def commit(self, capacity: int) -> None:
        """Apply the plan to the book, the table now holding `capacity` slots."""
        book = self.book
        for ad, slot in self.slot_of.items():
            if slot is None:
                book.slot_of.pop(ad, None)
            else:
                book.slot_of[ad] = slot
        book.version.update(self.version)
        book.free[:0] = range(capacity - 1, self.capacity - 1, -1)  # grown slots come after the old free ones
        if self.taken:
            book.high_water = max(book.high_water, max(book.free[-self.taken:]) + 1)
            del book.free[-self.taken:]
        book.free.extend(reversed(self.freed))
