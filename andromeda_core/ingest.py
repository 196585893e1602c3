"""Raw ad events -> validated, compiled, embedded index operations."""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Sequence

from andromeda_core.errors import InvalidInput
from andromeda_core.ops import IndexOp, PreparedAd
from andromeda_core.models import Scorer
from andromeda_core.schema import Schema
from andromeda_core.targeting import CompiledTargeting, compile_targeting
from andromeda_core.types import DeleteEvent, StatusEvent, UpsertEvent, parse_event

AdEventModel = UpsertEvent | DeleteEvent | StatusEvent


class EventBatch(list):
    """Parsed events read together, and `where[i]`: the file and line of event i."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []


def read_events(path: str | Path, batch_size: int = 10000,
                on_bytes: Callable[[int], None] | None = None) -> Iterator[EventBatch]:
    """Parse a JSONL file of ad events in batches; an error names the file, line and field.
    `on_bytes(n)` is told how many bytes each line took (for progress bars)."""
    with open(path, "rb") as f:
        yield from events_in(f, str(path), batch_size, on_bytes)


def events_in(f: BinaryIO, name: str, batch_size: int = 10000, on_bytes: Callable[[int], None] | None = None,
              limit: int | None = None) -> Iterator[EventBatch]:
    """read_events of an open binary file from where it stands, up to `limit` bytes (None: to its end); errors name
    the file as `name`."""
    batch = EventBatch()
    lines = f if limit is None else _lines_within(f, limit)
    for lineno, line in enumerate(lines, 1):
        if on_bytes:
            on_bytes(len(line))
        if lineno == 1:  # a byte order mark, as HTTP bodies may start with (an editor's UTF-8 "with BOM")
            line = line.removeprefix(codecs.BOM_UTF8)
        if line.strip():
            where = f"{name}:{lineno}"
            batch.append(parse_event(line, where))
            batch.where.append(where)
        if len(batch) >= batch_size:
            yield batch
            batch = EventBatch()
    if batch:
        yield batch


def _lines_within(f: BinaryIO, limit: int) -> Iterator[bytes]:
    """The lines of f's next `limit` bytes (the last cut there)."""
    for line in f:
        if limit <= 0:
            return
        yield line[:limit]
        limit -= len(line)


def compile_upserts(schema: Schema, events: Sequence[AdEventModel],
                    where: Sequence[str] | None = None) -> dict[int, CompiledTargeting]:
    """The compiled targeting of each upsert's ad, by id(ad); raises InvalidInput naming the ad, and the
    event's place (`where[i]`, e.g. "[3]" or "events.jsonl:7") when given."""
    compiled = {}
    for i, event in enumerate(events):
        if isinstance(event, UpsertEvent):
            field = f"{where[i]}.ad.targeting" if where else "ad.targeting"
            try:
                compiled[id(event.ad)] = compile_targeting(schema, event.ad.targeting, field)
            except InvalidInput as exc:
                raise InvalidInput(f"{exc.message} (ad {event.ad.ad_id})", exc.field) from None
    return compiled


def prepare_ops(schema: Schema, scorer: Scorer, events: Sequence[AdEventModel],
                where: Sequence[str] | None = None) -> list[IndexOp]:
    """Compile targeting and run the ad tower (batched) for the upserts; raises InvalidInput as
    `compile_upserts` does. Nothing is changed on error."""
    compiled = compile_upserts(schema, events, where)
    upserts = [e.ad for e in events if isinstance(e, UpsertEvent)]
    embeddings = scorer.encode_ads(upserts).numpy() if upserts else None
    ops: list[IndexOp] = []
    row = 0
    for event in events:
        if isinstance(event, UpsertEvent):
            ops.append(PreparedAd(event.ad, compiled[id(event.ad)], embeddings[row]))
            row += 1
        else:
            ops.append(event)
    return ops


def load_events(index, schema: Schema, scorer: Scorer, batches: Iterable[EventBatch]) -> int:
    """Apply event batches to `index`; returns how many events changed it."""
    return sum(sum(index.apply(prepare_ops(schema, scorer, batch, batch.where))) for batch in batches)
