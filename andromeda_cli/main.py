"""The `andromeda` command: schema, synth, retrieve, demo (offline), publish (Redis), train, eval, and the
service commands of andromeda_cli.service (serve, up, serve-config)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Sequence

from pydantic import ValidationError
from tqdm import tqdm

from andromeda_cli.service import add_commands as add_service_commands

from andromeda_core.config import load_settings
from andromeda_core.errors import AndromedaError, InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.serving import load_scorer
from andromeda_core.quantization import STORAGE
from andromeda_core.retriever import Retriever
from andromeda_core.schema import Schema, load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import RetrieveRequest, parse_request

REQUEST_BATCH = 16  # requests sharing one pass over the table


def build_retriever(schema: Schema, events: Path, progress: bool = True, model: Path | None = None,
                    storage: str = "fp32") -> Retriever:
    """An in-process index loaded from an events JSONL file, scored by a trained model checkpoint
    (or, without one, the untrained hashed two-tower baseline)."""
    settings = load_settings()
    scorer = load_scorer(model, schema, settings.device)
    index = AdIndex(schema, scorer.dim, capacity=settings.index.initial_capacity, device=settings.device,
                    embedding_dtype=STORAGE[storage], exact_copy=settings.index.rescore > 0)
    with tqdm(total=events.stat().st_size, unit="B", unit_scale=True, desc="index", disable=not progress,
              file=sys.stderr, miniters=1 << 20) as bar:
        load_events(index, schema, scorer, read_events(events, on_bytes=bar.update))
    return Retriever(index, scorer, chunk_size=settings.index.chunk_size, rescore=settings.index.rescore)


def read_requests(path: Path, k: int | None) -> list[RetrieveRequest]:
    """One JSON request object, or a JSONL file of them."""
    text = path.read_text(encoding="utf-8")
    try:
        whole = json.loads(text)
        docs = [(str(path), whole)]
    except json.JSONDecodeError:
        docs = [(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if k is not None:  # the override is validated like the request's own k
        docs = [(where, {**_json_object(doc, where), "k": k}) for where, doc in docs]
    return [parse_request(doc, where) for where, doc in docs]


def _json_object(doc: str | dict, where: str) -> dict:
    try:
        value = json.loads(doc) if isinstance(doc, str) else doc
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"not JSON: {exc.msg}", where) from None
    if not isinstance(value, dict):
        raise InvalidInput(f"a request is a JSON object, got {type(value).__name__}", where)
    return value


def cmd_schema(args: argparse.Namespace) -> None:
    schema = load_schema(args.schema)
    if args.json:
        print(json.dumps(schema.to_json(), indent=1))
        return
    for c in schema.categories:
        detail = {"enum": f"{c.size} values", "ordinal": f"[{c.lo}, {c.hi}]", "id": f"cardinality {c.cardinality}"}[c.kind]
        print(f"{c.name:22} {c.kind:8} {detail:22} {'multi' if c.multi else 'single':7} {c.source:8} {c.encoding}")


def cmd_synth(args: argparse.Namespace) -> None:
    cfg = WorldConfig(ads=args.ads, users=args.users, seed=args.seed)
    out = synthesize(cfg, args.out, load_schema(args.schema), workers=args.workers)
    print(f"wrote {out}/events.jsonl, requests.jsonl, engagements.jsonl, truth.npz")


def cmd_retrieve(args: argparse.Namespace) -> None:
    schema = load_schema(args.schema)
    requests = read_requests(args.request, args.k)
    retriever = build_retriever(schema, args.events, progress=not args.quiet, model=args.model, storage=args.storage)
    for first in range(0, len(requests), REQUEST_BATCH):
        for response in retriever.retrieve(requests[first:first + REQUEST_BATCH], now=args.now):
            if isinstance(response, AndromedaError):
                raise response
            print(response.model_dump_json())


def cmd_demo(args: argparse.Namespace) -> None:
    schema = load_schema(args.schema)
    world = args.out
    if not (world / "requests.jsonl").exists():
        print(f"synthesising a demo world of {args.ads} ads and {args.users} users in {world}")
        synthesize(WorldConfig(ads=args.ads, users=args.users, seed=0), world, schema)
    retriever = build_retriever(schema, world / "events.jsonl", model=args.model, storage=args.storage)
    titles = {}
    for batch in read_events(world / "events.jsonl"):
        titles.update({e.ad.ad_id: e.ad.creative.title for e in batch if e.op == "upsert"})
    requests = read_requests(world / "requests.jsonl", k=5)[: args.show]
    print(f"\nindex: {len(retriever.index)} live ads, digest {retriever.index.digest()}")
    for request, response in zip(requests, retriever.retrieve(requests)):
        a = request.user.attributes
        print(f"\nuser {request.user.user_id} ({a.get('age')}, {a.get('country')}, interests "
              f"{', '.join(a.get('interests', [])[:4])}) on {request.context.surface}: "
              f"{response.eligible} eligible ads, top 5 in {response.took_ms:.1f} ms")
        for ad in response.ads:
            print(f"  {ad.score:6.3f}  ad {ad.ad_id:>6}  {titles[ad.ad_id]}")
    print(f"\nTry it yourself:\n  .venv/bin/andromeda retrieve --events {world}/events.jsonl "
          f"--request {world}/requests.jsonl --k 10 --quiet | head -3")


def cmd_train(args: argparse.Namespace) -> None:
    from andromeda_core.models.quality import checkpoint_meta, checkpoint_path, load_data
    from andromeda_core.models.train import TrainConfig, default_config, train

    data = load_data(args.data, args.world)
    cfg = default_config(args.model, args.seed)
    if args.steps is not None:
        cfg = TrainConfig(**{**cfg.__dict__, "steps": args.steps})
    teacher = None
    if args.teacher:
        from andromeda_core.models.distill import ask_teacher
        from andromeda_core.models.retrieval import RetrievalModel

        teacher = ask_teacher(RetrievalModel.load(args.teacher)[0], data)
    model = train(data, args.model, cfg, teacher)
    out = args.out or checkpoint_path(data.name, args.model)
    model.save(out, checkpoint_meta(data, args.seed, args.teacher, cfg.distill))
    print(f"wrote {out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from andromeda_core.models.quality import quality_report

    print(quality_report(tuple(args.data), args.out, retrain=args.retrain, world=args.world))


def cmd_publish(args: argparse.Namespace) -> None:
    import redis

    from index_updater.publisher import Publisher

    settings = load_settings()
    url = args.redis or settings.redis_url
    if not url:
        raise SystemExit("error: no Redis to publish to: pass --redis or set REDIS_URL")
    schema = load_schema(args.schema)
    scorer = load_scorer(args.model, schema, settings.device)
    publisher = Publisher(redis.Redis.from_url(url), schema, scorer, shards=args.shards or settings.shards,
                          stream=args.stream or settings.stream)
    with tqdm(unit="event", desc="publish", file=sys.stderr) as bar:
        total = publisher.publish_file(args.events, on_batch=bar.update)
    print(f"published {total} events to {publisher.stream} at {url}")


def add_model_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", type=Path, default=None, help="trained checkpoint (default: untrained hashed two-tower)")
    s.add_argument("--storage", choices=sorted(STORAGE), default="fp32", help="ad vector storage in the index")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andromeda", description=__doc__)
    p.add_argument("--schema", type=Path, default=None, help="targeting schema YAML (default: ANDROMEDA_SCHEMA or the shipped one)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("schema", help="print the active targeting schema")
    s.add_argument("--json", action="store_true", help="machine-readable JSON")
    s.set_defaults(func=cmd_schema)

    s = sub.add_parser("synth", help="write a synthetic ads world")
    s.add_argument("--ads", type=int, required=True)
    s.add_argument("--users", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--workers", type=int, default=2, help="processes generating ad chunks")
    s.set_defaults(func=cmd_synth)

    s = sub.add_parser("retrieve", help="build an index from events in process and answer requests")
    s.add_argument("--events", type=Path, required=True, help="ad events JSONL")
    s.add_argument("--request", type=Path, required=True, help="one request JSON object or a JSONL of them")
    s.add_argument("--k", type=int, default=None, help="override each request's k")
    s.add_argument("--now", type=int, default=None, help="server time in seconds for requests without context.ts")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_flags(s)
    s.set_defaults(func=cmd_retrieve)

    s = sub.add_parser("publish", help="validate, compile and append ad events to the Redis updates stream")
    s.add_argument("events", type=Path, help="ad events JSONL")
    s.add_argument("--redis", default=None, help="Redis URL (default: REDIS_URL)")
    s.add_argument("--stream", default=None, help="stream name (default: ANDROMEDA_STREAM)")
    s.add_argument("--shards", type=int, default=None, help="index shards (default: ANDROMEDA_SHARDS)")
    s.add_argument("--model", type=Path, default=None, help="checkpoint whose ad tower embeds the ads")
    s.set_defaults(func=cmd_publish)

    s = sub.add_parser("train", help="train a retrieval model (checkpoint in safetensors)")
    s.add_argument("--data", choices=("synthetic", "movielens"), required=True)
    s.add_argument("--model", choices=("moe", "two_tower", "dense", "ranker"), required=True)
    s.add_argument("--steps", type=int, default=None, help="override the default number of steps")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--teacher", type=Path, default=None,
                   help="ranker checkpoint to distil (its top-100 per user); `andromeda eval` uses DATA-ranker")
    s.add_argument("--world", type=Path, default=None, help="synthetic world directory (default: generated in the cache)")
    s.add_argument("--out", type=Path, default=None, help="checkpoint path (default: .cache/models/DATA-MODEL.safetensors)")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="quality report of every model on both data sets (writes docs/quality.md)")
    s.add_argument("--data", nargs="+", choices=("synthetic", "movielens"), default=["synthetic", "movielens"])
    s.add_argument("--retrain", action="store_true", help="train even where a checkpoint exists")
    s.add_argument("--world", type=Path, default=None)
    s.add_argument("--out", type=Path, default=Path("docs/quality.md"))
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("demo", help="offline demo: synthesise a world, index it, answer a few requests")
    s.add_argument("--out", type=Path, default=Path("var/demo"))
    s.add_argument("--ads", type=int, default=50000)
    s.add_argument("--users", type=int, default=100)
    s.add_argument("--show", type=int, default=3, help="requests to print")
    add_model_flags(s)
    s.set_defaults(func=cmd_demo)
    add_service_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `andromeda ... | head` ends quietly
    args = parser().parse_args(argv)
    if args.schema is None:
        args.schema = load_settings().schema_path
    try:
        args.func(args)
    except AndromedaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while starting: whatever was started is stopped by its finally
        return 130
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"error: config {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: {exc.filename}: no such file", file=sys.stderr)
        return 2
    return 0

