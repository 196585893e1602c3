"""A copy of an ad table taken while the table keeps applying batches (AdIndex.begin_export).

Copying a large table stops its updates for as long as the copy takes (on the 2-core dev box about 1.6 s for
1M ads, most of it getting fresh host memory), so the copy is taken in two steps: `copy_bulk` copies every
column as the table held it when the export began, in chunks, without the table's lock (in a thread of its own,
while batches are applied: a row may be copied half written); every slot a batch writes meanwhile is recorded,
and AdIndex.finish_export copies those again, and the rows added since, under the lock. The copy then equals
the table at the moment it finished."""
from __future__ import annotations

import torch

CHUNK_ROWS = 65536  # rows copied at once by copy_bulk
HEADROOM = 1 / 64  # rows the copy holds beyond the table's high-water mark, for ads added while it is taken


class TableCopy:
    """columns: the table's columns when the export began (name -> (capacity, ...) tensor, on its device);
    rows: its high-water mark then. After copy_bulk, `buffers` holds host copies of their first `rows` rows, with
    room for a few more."""

    def __init__(self, columns: dict[str, torch.Tensor], rows: int):
        self.columns, self.rows = dict(columns), rows
        self.buffers: dict[str, torch.Tensor] = {}
        self.written: list[torch.Tensor] = []  # slot tensors of the batches applied since the export began
        self.dropped = False  # the table was replaced (AdIndex.adopt): the copy is of another table
        self.bulk_done = False

    def copy_bulk(self) -> None:
        """Copy every column's first `rows` rows to host memory, a chunk at a time; safe to run while the table is
        written (rows written meanwhile are copied again by AdIndex.finish_export)."""
        room = self.rows + max(1024, int(self.rows * HEADROOM))
        for name, column in self.columns.items():
            buffer = torch.empty((room, *column.shape[1:]), dtype=column.dtype)
            for first in range(0, self.rows, CHUNK_ROWS):
                last = min(first + CHUNK_ROWS, self.rows)
                buffer[first:last].copy_(column[first:last])
            self.buffers[name] = buffer
        self.bulk_done = True

    def note_written(self, slots: torch.Tensor) -> None:
        """A batch wrote these slots (any device): copied again when the export finishes."""
        self.written.append(slots)

    def finished(self, columns: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        """The copy of `columns` (the table now, high-water mark `rows`; called under its lock, after copy_bulk):
        the rows written since the export began and those added since, copied again; name -> (rows, ...) host
        tensors."""
        if not self.bulk_done:
            raise RuntimeError("finish an export only after its bulk copy")
        again = torch.unique(torch.cat([s.flatten().cpu() for s in self.written])) if self.written else None
        out = {}
        for name, column in columns.items():
            buffer = self.buffers[name]
            if rows > len(buffer):  # more ads added than the headroom holds: the rows past it copied whole
                buffer = torch.cat([buffer[: self.rows], column[self.rows:rows].cpu()])
            else:
                buffer[self.rows:rows].copy_(column[self.rows:rows])
            if again is not None:
                stale = again[again < min(self.rows, rows)]
                buffer[stale] = column[stale.to(column.device)].cpu()
            out[name] = buffer[:rows]
        self.columns, self.buffers, self.written = {}, {}, []  # the table's old columns and the copy: not kept here
        return out
