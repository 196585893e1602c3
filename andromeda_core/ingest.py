"""Raw ad events -> validated, compiled, embedded index operations."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from andromeda_core.errors import InvalidInput
from andromeda_core.index import IndexOp, PreparedAd
from andromeda_core.models import Scorer
from andromeda_core.schema import Schema
from andromeda_core.targeting import compile_targeting
from andromeda_core.types import DeleteEvent, StatusEvent, UpsertEvent, parse_event

AdEventModel = UpsertEvent | DeleteEvent | StatusEvent


def read_events(path: str | Path, batch_size: int = 10000,
                on_bytes: Callable[[int], None] | None = None) -> Iterator[list[AdEventModel]]:
    """Parse a JSONL file of ad events in batches; an error names the file, line and field.
    `on_bytes(n)` is told how many bytes each line took (for progress bars)."""
    batch: list[AdEventModel] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if on_bytes:
                on_bytes(len(line))
            if line.strip():
                batch.append(parse_event(line, f"{path}:{lineno}"))
            if len(batch) >= batch_size:
                yield batch
                batch = []
    if batch:
        yield batch


def prepare_ops(schema: Schema, scorer: Scorer, events: Sequence[AdEventModel],
                where: Sequence[str] | None = None) -> list[IndexOp]:
    """Compile targeting and run the ad tower (batched) for the upserts; raises InvalidInput naming the
    ad, and the event's place (`where[i]`, e.g. "[3]") when given. Nothing is changed on error."""
    upserts = [(i, e.ad) for i, e in enumerate(events) if isinstance(e, UpsertEvent)]
    compiled = {}
    for i, ad in upserts:
        field = f"{where[i]}.ad.targeting" if where else "ad.targeting"
        try:
            compiled[id(ad)] = compile_targeting(schema, ad.targeting, field)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc.message} (ad {ad.ad_id})", exc.field) from None
    embeddings = scorer.encode_ads([ad for _, ad in upserts]).numpy() if upserts else None
    ops: list[IndexOp] = []
    row = 0
    for event in events:
        if isinstance(event, UpsertEvent):
            ops.append(PreparedAd(event.ad, compiled[id(event.ad)], embeddings[row]))
            row += 1
        else:
            ops.append(event)
    return ops


def load_events(index, schema: Schema, scorer: Scorer, batches: Iterable[Sequence[AdEventModel]]) -> int:
    """Apply event batches to `index`; returns how many events changed it."""
    return sum(sum(index.apply(prepare_ops(schema, scorer, batch))) for batch in batches)
