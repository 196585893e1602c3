"""The `andromeda` command: schema, synth, retrieve, demo (offline), publish (Redis), train, eval, and the
service commands of andromeda_cli.service (serve, up, serve-config) and the Kubernetes manifests'
generator of andromeda_cli.k8s (k8s-config)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from pydantic import ValidationError
from tqdm import tqdm

from andromeda_cli.args import (NON_NEGATIVE, POSITIVE, checkpoint, input_file, int_in, non_negative_float,
                                output_dir, output_file, stream_name, WORLD_MAX)
from andromeda_cli.k8s import add_commands as add_k8s_commands
from andromeda_cli.request_file import read_requests
from andromeda_cli.service import add_commands as add_service_commands, cli_command

from andromeda_core.config import Settings, load_settings, redact, stream_problem, tls_hint
from andromeda_core.errors import AndromedaError, InvalidInput
from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.quality import DATASETS
from andromeda_core.models.serving import load_scorer
from andromeda_core.quantization import STORAGE
from andromeda_core.retriever import Retriever
from andromeda_core.schema import Schema, load_schema
from andromeda_core.synth import WorldConfig, synthesize, world_config
from andromeda_core.types import K_MAX, TIME_LIMIT
from kernels.cpu import BuildError

REQUEST_BATCH = 16  # requests sharing one pass over the table
DEMO_ADS, DEMO_USERS = 50000, 100


def build_retriever(schema: Schema, events: Path, progress: bool = True, model: Path | None = None,
                    storage: str = "fp32") -> Retriever:
    """An in-process index loaded from an events JSONL file, scored by a trained model checkpoint
    (or, without one, the untrained hashed two-tower baseline)."""
    settings = load_settings()
    device = local_device(settings)
    with checkpoint("--model", model):
        scorer = load_scorer(model, schema, device)
    index = AdIndex(schema, scorer.dim, capacity=settings.index.initial_capacity, device=device,
                    embedding_dtype=STORAGE[storage], exact_copy=settings.index.rescore > 0)
    with tqdm(total=events.stat().st_size, unit="B", unit_scale=True, desc="index", disable=not progress,
              file=sys.stderr, miniters=1 << 20) as bar:
        load_events(index, schema, scorer, read_events(events, on_bytes=bar.update))
    return Retriever(index, scorer, rescore=settings.index.rescore)


def local_device(settings: Settings) -> str:
    """ANDROMEDA_DEVICE, if this machine has it."""
    device = torch.device(settings.device)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise InvalidInput(f"{settings.device} is not here: this machine has {torch.cuda.device_count()} CUDA "
                           f"device(s) (torch {torch.__version__})", "ANDROMEDA_DEVICE")
    return settings.device


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
    if args.quiet:  # the text model's own loading bars too (read when transformers is first imported)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    schema = load_schema(args.schema)
    requests = read_requests(args.request, schema, args.k)
    retriever = build_retriever(schema, args.events, progress=not args.quiet, model=args.model, storage=args.storage)
    for first in range(0, len(requests), REQUEST_BATCH):
        for response in retriever.retrieve(requests[first:first + REQUEST_BATCH], now=args.now):
            if isinstance(response, AndromedaError):
                raise response
            print(response.model_dump_json())


def cmd_demo(args: argparse.Namespace) -> None:
    schema = load_schema(args.schema)
    world = args.out
    cfg = world_config(world)
    if cfg is None:
        cfg = WorldConfig(ads=args.ads or DEMO_ADS, users=args.users or DEMO_USERS, seed=0)
        print(f"synthesising a demo world of {cfg.ads} ads and {cfg.users} users in {world}")
        synthesize(cfg, world, schema)
    else:
        for option, asked, held in (("--ads", args.ads, cfg.ads), ("--users", args.users, cfg.users)):
            if asked not in (None, held):
                raise InvalidInput(f"{world} holds a world of {cfg.ads} ads and {cfg.users} users: pass another "
                                   f"--out for a new one", option)
        print(f"using the demo world of {cfg.ads} ads and {cfg.users} users in {world}")
    retriever = build_retriever(schema, world / "events.jsonl", model=args.model, storage=args.storage)
    titles = {}
    for batch in read_events(world / "events.jsonl"):
        titles.update({e.ad.ad_id: e.ad.creative.title for e in batch if e.op == "upsert"})
    requests = read_requests(world / "requests.jsonl", schema, k=5)[: args.show]
    print(f"\nindex: {len(retriever.index)} live ads, digest {retriever.index.digest()}")
    for request, response in zip(requests, retriever.retrieve(requests)):
        a = request.user.attributes
        print(f"\nuser {request.user.user_id} ({a.get('age')}, {a.get('country')}, interests "
              f"{', '.join(a.get('interests', [])[:4])}) on {request.context.surface}: "
              f"{response.eligible} eligible ads, top 5 in {response.took_ms:.1f} ms")
        for ad in response.ads:
            print(f"  {ad.score:6.3f}  ad {ad.ad_id:>6}  {titles[ad.ad_id]}")
    command = shlex.join([cli_command(), "retrieve", "--events", str((world / "events.jsonl").resolve()), "--request",
                          str((world / "requests.jsonl").resolve()), "--k", "10", "--quiet"])  # from any folder
    print(f"\nTry it yourself:\n  {command} | head -3")


def cmd_train(args: argparse.Namespace) -> None:
    from andromeda_core.models.distill import ask_teacher
    from andromeda_core.models.quality import checkpoint_meta, checkpoint_path, load_data
    from andromeda_core.models.retrieval import RetrievalModel
    from andromeda_core.models.train import check_start, default_config, other_start, train

    if args.distill is not None and args.teacher is None:
        raise InvalidInput("--distill needs --teacher (the ranker checkpoint to distil)", "--distill")
    if args.teacher is not None and args.init is None:
        raise InvalidInput("--teacher needs --init (the trained model distillation continues from)", "--teacher")
    if args.teacher is not None and args.distill == 0:
        raise InvalidInput("--distill 0 takes no teacher: leave out --teacher for the same steps without one", "--distill")
    with checkpoint("--teacher", args.teacher):  # a bad --teacher or --init fails before the data is loaded
        ranker = RetrievalModel.load(args.teacher)[0] if args.teacher else None
    if ranker is not None and ranker.kind != "ranker":
        raise InvalidInput(f"{args.teacher} is a {ranker.kind} model: the teacher must be a ranker checkpoint", "--teacher")
    with checkpoint("--init", args.init):
        init = RetrievalModel.load(args.init)[0] if args.init else None
    try:
        if init is not None:
            check_start(args.model, init.kind)
    except ValueError as exc:
        raise InvalidInput(f"{args.init} is a {init.kind} model: {exc}", "--init") from None
    distill = (0.5 if args.distill is None else args.distill) if ranker is not None else 0.0
    start = other_start(args.model, init)
    going_on = init is not None and init.kind == args.model == "moe"  # the steps distillation takes, taught or not
    out = args.out or checkpoint_path(args.data, args.model, distill, start, going_on)
    for flag, path in (("--init", args.init), ("--teacher", args.teacher)):
        if path is not None and out.resolve() == path.resolve():
            raise InvalidInput(f"the new checkpoint would overwrite {flag} {path}: name another with --out", "--out")
    if args.data == "movielens" and args.world is not None:
        raise InvalidInput("--world is a synthetic world's folder; --data movielens reads ANDROMEDA_MOVIELENS", "--world")
    if args.data == "movielens" and args.click_weight is not None:  # before loading it (its texts embed for minutes)
        raise InvalidInput("--data movielens logs no impressions, so a model of it holds no click prior to weigh",
                           "--click-weight")
    try:  # before the data and the training, not after
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInput(f"{out}: cannot create its folder {out.parent} ({exc.strerror})", "--out") from None
    data = load_data(args.data, args.world)
    if args.click_weight is not None and not data.click_logodds().any():
        raise InvalidInput(f"--data {args.data} logs no impressions, so a model of it holds no click prior to weigh",
                           "--click-weight")
    cfg = default_config(args.model, args.seed, distill, start, going_on, examples=len(data.train_examples()))
    cfg = dataclasses.replace(cfg, steps=args.steps or cfg.steps,
                              click_weights=cfg.click_weights if args.click_weight is None else (args.click_weight,))
    learned = np.sort(data.items.ids[data.train_items(cfg.min_id_engagements)])  # the ads training here gives ids
    fits = init is None or np.array_equal(init.item_ids.numpy(), learned)
    if not fits:  # a model of other data (its learned ids are not the ads trained on here), refused before the
        # teacher's rankings, which take minutes
        raise InvalidInput(f"{args.init} was trained on other data than --data {args.data}", "--init")
    teacher = ask_teacher(ranker, data) if ranker is not None else None
    model = train(data, args.model, cfg, teacher, init)
    model.save(out, checkpoint_meta(data, args.seed, args.teacher, cfg.distill, args.init,
                                    len(teacher.users) if teacher is not None else 0, cfg))
    print(f"wrote {out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from andromeda_core.models.quality import quality_report

    print(quality_report(tuple(args.data), args.out, retrain=args.retrain, world=args.world, workers=args.workers))


def cmd_publish(args: argparse.Namespace) -> None:
    import redis

    from index_updater.clients import unsupported_options
    from index_updater.publisher import TRANSIENT, Publisher

    settings = load_settings()
    url, option = (args.redis, "--redis") if args.redis is not None else (settings.redis_url, "REDIS_URL")
    if not url:
        raise InvalidInput("is empty" if args.redis is not None else "no Redis to publish to: pass --redis or set "
                           "REDIS_URL", "--redis")
    if args.stream is None and (problem := stream_problem(settings.stream)):  # the service would refuse it
        raise InvalidInput(problem, "ANDROMEDA_STREAM")
    if why := unsupported_options(url):
        raise InvalidInput(why, option)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5)
    except ValueError as exc:
        raise InvalidInput(redact(exc), option) from None
    schema = load_schema(args.schema)
    with checkpoint("--model", args.model):
        scorer = load_scorer(args.model, schema, local_device(settings))
    publisher = Publisher(client, schema, scorer, shards=args.shards or settings.shards,
                          stream=args.stream or settings.stream, attempts=args.tries)
    try:
        publisher.check_streams()  # an unreachable Redis fails here, before the file is read
        check_layout(publisher, args)
        with tqdm(unit="event", desc="publish", file=sys.stderr) as bar:
            total = publisher.publish_file(args.events, on_batch=bar.update)
    except redis.RedisError as exc:
        hint = f" (gave up after --tries {args.tries})" if isinstance(exc, TRANSIENT) else ""
        raise AndromedaError(f"Redis at {redact(url)}: {redact(exc)}{tls_hint(exc)}{hint}") from None
    print(f"published {total} events to {publisher.stream} at {redact(url)}")


LAYOUT_FLAGS = {"shards": "--shards (or ANDROMEDA_SHARDS)", "schema": "andromeda --schema (or ANDROMEDA_SCHEMA)",
                "model": "--model", "dim": "--model"}


def check_layout(publisher, args: argparse.Namespace) -> None:
    """Refuse to publish what the replicas reading the stream would not apply (entries for a shard stream no
    replica reads, or dead letters), naming the flag to fix."""
    mismatch = publisher.layout_mismatch()
    if mismatch:
        field, (theirs, ours) = next(iter(mismatch.items()))
        raise InvalidInput(f"the replicas reading {publisher.stream} apply {field} {theirs}; this would publish "
                           f"{field} {ours}, which they would not apply. Nothing was published", LAYOUT_FLAGS[field])


def cmd_token(args: argparse.Namespace) -> None:
    from deployments.auth import NAME, add_token

    if not NAME.fullmatch(args.name):
        raise InvalidInput("must be 1-64 letters, digits, '_' or '-'", "--name")
    if args.role == "advertiser" and args.advertiser is None:
        raise InvalidInput("--role advertiser needs --advertiser (the advertiser_id the token may write for)",
                           "--advertiser")
    if args.role != "advertiser" and args.advertiser is not None:
        article = "an" if args.role[0] in "aeiou" else "a"
        raise InvalidInput(f"only --role advertiser takes --advertiser ({article} {args.role} token is not tied to one)",
                           "--advertiser")
    try:
        token = add_token(args.file, args.name, args.role, args.advertiser)
    except ValueError as exc:
        raise InvalidInput(str(exc), str(args.file)) from None
    except OSError as exc:
        raise InvalidInput(f"{args.file}: {exc.strerror}", "--file") from None
    print(f"added {args.role} token {args.name} to {args.file} (only its salted hash is stored; this is the only "
          f"time the token is shown):", file=sys.stderr)
    print(token)


def add_model_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", type=input_file, default=None, help="trained checkpoint (default: untrained hashed two-tower)")
    s.add_argument("--storage", choices=sorted(STORAGE), default="fp32", help="ad vector storage in the index")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andromeda", description=__doc__)
    p.add_argument("--schema", type=input_file, default=None,
                   help="targeting schema YAML (default: ANDROMEDA_SCHEMA or the shipped one)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("schema", help="print the active targeting schema")
    s.add_argument("--json", action="store_true", help="machine-readable JSON")
    s.set_defaults(func=cmd_schema)

    s = sub.add_parser("synth", help="write a synthetic ads world")
    s.add_argument("--ads", type=int_in(1, WORLD_MAX), required=True, help="number of ads")
    s.add_argument("--users", type=int_in(1, WORLD_MAX), required=True, help="number of users (one request each)")
    s.add_argument("--seed", type=NON_NEGATIVE, default=0, help="random seed; a seed gives the same world")
    s.add_argument("--out", type=output_dir, required=True, help="directory to write the world into")
    s.add_argument("--workers", type=int_in(1, 256), default=2, help="processes generating ad chunks")
    s.set_defaults(func=cmd_synth)

    s = sub.add_parser("retrieve", help="build an index from events in process and answer requests")
    s.add_argument("--events", type=input_file, required=True, help="ad events JSONL")
    s.add_argument("--request", type=input_file, required=True, help="one request JSON object or a JSONL of them")
    s.add_argument("--k", type=int_in(1, K_MAX), default=None, help="override each request's k")
    s.add_argument("--now", type=int_in(0, TIME_LIMIT - 1), default=None,
                   help="server time in seconds for requests without context.ts")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_flags(s)
    s.set_defaults(func=cmd_retrieve)

    s = sub.add_parser("publish", help="validate, compile and append ad events to the Redis updates stream")
    s.add_argument("events", type=input_file, help="ad events JSONL (checked in full before anything is appended)")
    s.add_argument("--redis", default=None, help="Redis URL (default: REDIS_URL)")
    s.add_argument("--stream", type=stream_name, default=None, help="stream name (default: ANDROMEDA_STREAM)")
    s.add_argument("--shards", type=int_in(1, 1024), default=None, help="index shards (default: ANDROMEDA_SHARDS)")
    s.add_argument("--model", type=input_file, default=None, help="checkpoint whose ad tower embeds the ads")
    s.add_argument("--tries", type=int_in(1, 100), default=5,
                   help="tries of each Redis call on connection errors, with backoff from 0.05 s (default 5)")
    s.set_defaults(func=cmd_publish)

    s = sub.add_parser("train", help="train a retrieval model (checkpoint in safetensors)")
    s.add_argument("--data", choices=DATASETS, required=True, help="data set to train on")
    s.add_argument("--model", choices=("moe", "two_tower", "sasrec", "ranker"), required=True, help="model kind")
    s.add_argument("--steps", type=int_in(1, 10**9), default=None, help="override the default number of steps")
    s.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="random seed of the initialisation and batches")
    s.add_argument("--click-weight", type=non_negative_float, default=None,
                   help="weight of the click prior in each ad's bias, instead of the one validation chooses among 0, "
                        "1, 2, 4 and 8: higher favours the ads clicked most per impression (the true affinity) over "
                        "the logged next click (docs/quality.md, 'The click prior'); refused for data without impressions "
                        "(MovieLens). `andromeda eval` trains again a checkpoint of its names written this way")
    s.add_argument("--teacher", type=input_file, default=None,
                   help="ranker checkpoint to distil (its top-100 for the first users with a validation "
                        "engagement, as many as `andromeda eval` asks); `andromeda eval` uses DATA-ranker")
    s.add_argument("--distill", type=non_negative_float, default=None, help="weight of the distillation rows (default 0.5 with --teacher)")
    s.add_argument("--init", type=input_file, default=None,
                   help="checkpoint to start from: a moe goes on from a moe's weights for the steps distillation "
                        "takes (300 at LR 5e-4, with or without --teacher), any other model trains in full from the "
                        "weights of its own kind (a moe also from a sasrec's); a ranker starts from a MoE's towers, "
                        "frozen")
    s.add_argument("--world", type=output_dir, default=None,
                   help="synthetic world directory (default: in the cache; a world is generated there when it holds none)")
    s.add_argument("--out", type=output_file, default=None, help="checkpoint path (default: .cache/models/DATA-MODEL.safetensors; a moe "
                   "from a sasrec: DATA-moe-from-sasrec; a moe going on from a moe: DATA-moe-distillW, W = 0 "
                   "without --teacher)")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="quality report of every model and baseline on every data set; trains the missing "
                                    "checkpoints (about an hour on 2 CPU cores: 44 to 83 minutes measured) and "
                                    "rewrites docs/quality.md")
    s.add_argument("--data", nargs="+", choices=DATASETS, default=list(DATASETS),
                   help="data sets to evaluate (default: MovieLens and both synthetic worlds)")
    s.add_argument("--retrain", action="store_true", help="train even where a checkpoint exists")
    s.add_argument("--world", type=output_dir, default=None,
                   help="world directory for the `synthetic` data set (default: in the cache; generated where it holds none; "
                        "a world of an older generator is refused)")
    s.add_argument("--out", type=output_file, default=Path("docs/quality.md"), help="report file to rewrite (default docs/quality.md)")
    s.add_argument("--workers", type=int_in(1, 256), default=None,
                   help="processes the data sets run in side by side, the cores shared among them as torch threads "
                        "(default: one per data set; one on a single core)")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("demo", help="offline demo: synthesise a world, index it, answer a few requests")
    s.add_argument("--out", type=output_dir, default=Path("var/demo"),
                   help="world directory: used if it holds one, else written (default var/demo)")
    s.add_argument("--ads", type=int_in(1, WORLD_MAX), default=None, help=f"ads of a new world (default {DEMO_ADS})")
    s.add_argument("--users", type=int_in(1, WORLD_MAX), default=None, help=f"users of a new world (default {DEMO_USERS})")
    s.add_argument("--show", type=NON_NEGATIVE, default=3, help="requests to print")
    add_model_flags(s)
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("token", help="add (or replace) a named bearer token in a token file (auth.token_file); "
                                     "prints the token once")
    s.add_argument("--file", type=Path, required=True, help="token file (JSON of salted hashes; created if missing)")
    s.add_argument("--name", required=True, help="the token's name (1-64 letters, digits, '_' or '-')")
    s.add_argument("--role", choices=("admin", "advertiser", "reader"), default="advertiser", help="default advertiser")
    s.add_argument("--advertiser", type=int_in(0, 2**63 - 1), default=None, help="advertiser id (role advertiser)")
    s.set_defaults(func=cmd_token)
    add_service_commands(sub)
    add_k8s_commands(sub)
    return p


USER_ERRORS = (AndromedaError, ValidationError, OSError, BuildError)  # the user can act on these; others are bugs


def message(exc: Exception) -> str:
    """The one-line message of one of USER_ERRORS."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return f"config {'.'.join(map(str, err['loc']))}: {err['msg']}"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from_env = args.schema is None and "ANDROMEDA_SCHEMA" in os.environ
    args.schema_source = "--schema" if args.schema is not None else "ANDROMEDA_SCHEMA" if from_env else None
    try:
        if args.schema is None:
            args.schema = load_settings().schema_path
        args.func(args)
        sys.stdout.flush()  # here, not at exit, so a reader that went away is met by the handler below
    except BrokenPipeError:  # `andromeda ... | head` ends quietly (not by SIGPIPE's default, which would also kill
        # the process on any other broken pipe: a stopped eval worker's queue, a Redis socket)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
        return 141  # the status of a shell tool ended by a closed pipe
    except KeyboardInterrupt:  # Ctrl-C while starting: whatever was started is stopped by its finally
        return 130
    except USER_ERRORS as exc:
        unread_schema = from_env and isinstance(exc, OSError) and exc.filename == str(args.schema)
        where = "ANDROMEDA_SCHEMA: " if unread_schema else ""
        print(f"error: {where}{redact(message(exc))}", file=sys.stderr)  # never a Redis password
        return 2
    return 0
