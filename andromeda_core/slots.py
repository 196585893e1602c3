"""Host-side bookkeeping of an ad table: which slot holds which ad, the newest version of every ad seen,
free slots; and the plan of one batch of ops worked out on an overlay of it before anything is written."""
from __future__ import annotations

from andromeda_core.ops import DELETE, PAUSE, RESUME, UPSERT


class SlotBook:
    """Host-side bookkeeping of a table, read without touching the device: live ad -> slot, the version of every
    ad's content (its newest upsert; or the delete or expiry that removed it: a tombstone), the newest pause or
    resume of every ad where it is newer than that (the ad's status; for an ad not indexed, the status its create
    takes if older), free slots, high-water mark."""

    def __init__(self, capacity: int) -> None:
        self.slot_of: dict[int, int] = {}
        self.version: dict[int, int] = {}
        self.status: dict[int, tuple[int, bool]] = {}  # ad -> (version, active) of a pause / resume newer than version
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: lowest slot first
        self.high_water = 0  # slots >= high_water have never held an ad; scans stop there
        self.dead: set[int] = set()  # the ads of `version` not in slot_of (deleted or expired), kept as they change
        self.expired: dict[int, int] = {}  # ad -> its advertiser, for a tombstone left by expiry: the ad is still
        # its owner's (an advertiser's write to the id is checked against it: index_updater/owners.py)

    def tombstones(self) -> dict[int, int]:
        """ad_id -> the version that deleted or expired it (as many steps as there are tombstones, not ads)."""
        return {ad: self.version[ad] for ad in self.dead}

    def newest(self, ad: int) -> int | None:
        """The newest version applied for `ad` (content or status), None if never seen."""
        versions = [v for v in (self.version.get(ad), self.status.get(ad, (None,))[0]) if v is not None]
        return max(versions) if versions else None


def newer_status(code: int, version: int, status: tuple[int, bool]) -> bool:
    """Whether a pause or resume at `version` replaces the status (version, active) applied: when newer, or a pause
    of an ad resumed at the same version (a pause wins the tie, whichever arrived first)."""
    return version > status[0] or (version == status[0] and code == PAUSE and status[1])


class SlotPlan:
    """One batch's effect, worked out on an overlay of a SlotBook that stays untouched until `commit`.

    An upsert's content and a pause's or resume's status are versioned apart, so that ops reordered between
    writers converge: an upsert older than the ad's newest pause or resume still brings its content, and takes
    that status (of an ad not indexed yet too); a status change older than the content is stale. At one
    version the upsert's own status wins, and a pause wins over a resume (whichever came first)."""

    def __init__(self, book: SlotBook, capacity: int) -> None:
        self.book, self.capacity = book, capacity
        self.slot_of: dict[int, int | None] = {}  # ad -> slot after the batch, None when released
        self.version: dict[int, int] = {}  # ad -> content version after the batch
        self.status: dict[int, tuple[int, bool] | None] = {}  # ad -> status entry after the batch, None: dropped
        self.row_at: dict[int, int] = {}  # slot -> the batch row written there
        self.active: dict[int, bool] = {}  # slot -> ACTIVE bit set over its row's status, if any
        self.ad_at: dict[int, int] = {}  # slot -> ad, for every slot whose status and version are rewritten
        self.freed: list[int] = []
        self.expired: dict[int, int] = {}  # ad -> advertiser, of the ads this plan expires
        self.taken = 0  # new slots: from the end of the free list, then past the capacity

    @property
    def capacity_needed(self) -> int:
        return self.capacity + max(0, self.taken - len(self.book.free))

    def content_version(self, ad: int) -> int:
        return self.version.get(ad, self.book.version.get(ad, -1))

    def status_of(self, ad: int) -> tuple[int, bool] | None:
        return self.status[ad] if ad in self.status else self.book.status.get(ad)

    def newest(self, ad: int) -> int:
        """The ad's version after the batch: its content's or its status's, the newer."""
        status = self.status_of(ad)
        return max(self.content_version(ad), status[0] if status else -1)

    def op(self, code: int, ad: int, version: int, row: int) -> bool:
        """Plan one op; False when it is a no-op (not newer than what it would change)."""
        slot = self.slot_of[ad] if ad in self.slot_of else self.book.slot_of.get(ad)
        status = self.status_of(ad)
        stale_status = code in (PAUSE, RESUME) and status is not None and not newer_status(code, version, status)
        if version <= self.content_version(ad) or stale_status:
            return False
        if code in (PAUSE, RESUME):
            self.status[ad] = (version, code == RESUME)
            if slot is not None:
                self.active[slot], self.ad_at[slot] = code == RESUME, ad
            return True
        if status and status[0] <= version:
            self.status[ad] = status = None  # older than the content or the tombstone: it can never apply
        if code == DELETE:
            if slot is not None:
                self.release(ad, slot, version)
            self.version[ad] = version  # kept when not indexed too: a late, older upsert must not resurrect it
            return True
        slot = self._take() if slot is None else slot
        self.row_at[slot] = row
        if status:  # a newer pause or resume than this content
            self.active[slot] = status[1]
        else:
            self.active.pop(slot, None)
        self.slot_of[ad], self.ad_at[slot], self.version[ad] = slot, ad, version
        return True

    def expire(self, ad: int, slot: int, advertiser: int) -> None:
        """Free the slot of an ad past its end, leaving a tombstone at its version that keeps its advertiser."""
        self.release(ad, slot, self.content_version(ad))
        self.expired[ad] = advertiser

    def release(self, ad: int, slot: int, version: int) -> None:
        """Free the ad's slot, leaving a tombstone at `version`."""
        self.slot_of[ad], self.version[ad] = None, version
        status = self.status_of(ad)
        if status and status[0] <= version:
            self.status[ad] = None
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
        for ad in self.version:  # every ad whose slot changed is here too
            if ad in book.slot_of:
                book.dead.discard(ad)
            else:
                book.dead.add(ad)
            book.expired.pop(ad, None)  # its content changed since it expired (an upsert, a delete)
        book.expired.update(self.expired)
        for ad, status in self.status.items():
            if status is None:
                book.status.pop(ad, None)
            else:
                book.status[ad] = status
        book.free[:0] = range(capacity - 1, self.capacity - 1, -1)  # grown slots come after the old free ones
        if self.taken:
            book.high_water = max(book.high_water, max(book.free[-self.taken:]) + 1)
            del book.free[-self.taken:]
        book.free.extend(reversed(self.freed))
