"""`andromeda serve`, `andromeda up` and `andromeda serve-config`: the service on a local Ray."""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from pydantic import ValidationError
from tqdm import tqdm

from andromeda_cli.args import WORLD_MAX, checkpoint, input_file, int_in
from andromeda_core.config import load_settings, redact, tls_hint
from andromeda_core.errors import AndromedaError, InvalidInput
from andromeda_core.schema import DEFAULT_SCHEMA_PATH, Schema, load_schema, read_yaml
from andromeda_core.synth import WorldConfig, synthesize
from deployments.config import APP_NAME, ServiceConfig

REDIS_CHECK_S = 1.0  # how often `up` checks that the redis-server it started runs
CRASH_LOOP_S = 30.0  # a redis-server that dies again this soon after `up` restarted it is not restarted again
DEMO_USERS = 1000
DEMO_TRAIN_STEPS = 150
DEMO_MARK = "andromeda:demo"  # and ":<stream>": in up's Redis, the demo_identity those streams were published for


def read_config_file(path: Path | None) -> dict:
    """The ServiceConfig fields of a YAML file (a mapping); a clear error for anything else."""
    if path is None:
        return {}
    base = read_yaml(path)
    if not isinstance(base, dict):
        raise InvalidInput(f"expected a mapping of ServiceConfig fields, got {type(base).__name__}", f"--config {path}")
    return base


ENV_SOURCES = {"stream": "ANDROMEDA_STREAM", "shards": "ANDROMEDA_SHARDS", "rescore": "ANDROMEDA_RESCORE",
               "initial_capacity": "ANDROMEDA_INITIAL_CAPACITY"}


def service_config(args: argparse.Namespace, redis_url: str | None, check_files: bool = True,
                   redis_source: str = "REDIS_URL") -> ServiceConfig:
    """The config: the environment's settings (REDIS_URL, ANDROMEDA_SCHEMA, _STREAM, _SHARDS, _RESCORE, ...),
    then the config file (--config), then the command-line flags (--schema and, with redis_source "--redis",
    redis_url among them). With `check_files`, what the replicas read at start is read here first (model, schema,
    token file, snapshot folder), so that a bad one fails before Ray starts."""
    settings = load_settings()
    schema_source = getattr(args, "schema_source", None) or "ANDROMEDA_SCHEMA"  # main() sets it: --schema, or not
    env = {"redis_url": redis_url, "stream": settings.stream, "shards": settings.shards,
           "schema_path": None if args.schema == DEFAULT_SCHEMA_PATH else str(args.schema), "rescore": settings.index.rescore,
           "initial_capacity": settings.index.initial_capacity}
    flags = {"host": args.host, "port": args.port, "shards": args.shards, "replicas": args.replicas,
             "model": str(args.model) if args.model else None, "storage": args.storage}  # each field's flag: --<field>
    sources = {**ENV_SOURCES, "redis_url": redis_source, "schema_path": schema_source}
    if redis_source == "--redis":  # flags: above the config file
        flags["redis_url"] = env.pop("redis_url")
    if schema_source == "--schema":  # str(args.schema) even for the shipped schema, which env leaves out
        env.pop("schema_path")
        flags["schema_path"] = str(args.schema)
    given = {k: v for k, v in flags.items() if v is not None}
    from_file = read_config_file(args.config)
    for field in env:
        if field in from_file and from_file[field] is None:  # would hide the environment's value behind "not set"
            raise InvalidInput("null is not a value: leave the field out for its default", f"{args.config}: {field}")

    def source(field: str, path: str = "") -> str:
        """Where the field's value came from, as an error names it: its flag, else the config file and the field's
        path in it, else the environment variable that set it."""
        if field in given:
            return sources[field] if field in ("redis_url", "schema_path") else f"--{field}"
        if field in from_file:
            return f"{args.config}: {path or field}"
        return sources.get(field, f"config {path or field}")

    try:
        config = ServiceConfig.model_validate({**{k: v for k, v in env.items() if v is not None}, **from_file, **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(map(str, err["loc"]))
        raise InvalidInput(err["msg"], source(str(err["loc"][0]), loc) if err["loc"] else "config") from None
    if not check_files:
        return config
    check_start_files(config, source)
    paths = {"model": config.model, "schema_path": config.schema_path, "snapshot_dir": config.snapshot_dir}
    auth = config.auth.model_copy(update={"token_file": str(Path(config.auth.token_file).resolve())}) \
        if config.auth.token_file else config.auth
    return config.model_copy(update={"auth": auth, **{k: str(Path(v).resolve()) for k, v in paths.items() if v}})  # Ray
    # workers' cwd may differ


def check_start_files(config: ServiceConfig, source) -> None:
    """Reads what every replica reads at start, as it reads it: a bad one is an InvalidInput naming its source
    (source(field, path)) here, not a failed deployment after Ray started."""
    from deployments.auth import TokenStore

    for name, path in (("model", config.model), ("schema_path", config.schema_path)):
        if path and not Path(path).is_file():
            raise InvalidInput(f"{path} is not a file", source(name))
    schema = load_schema(config.schema_path)  # its errors name the file
    if config.model:  # every replica would fail to start on it: loaded as they load it (a ranker's is refused here)
        from andromeda_core.models.serving import ModelScorer

        with checkpoint(source("model"), Path(config.model)):
            ModelScorer.load(config.model, schema)
    if config.auth.token_file:
        try:
            TokenStore(None, config.auth.token_file)
        except OSError as exc:
            raise InvalidInput(f"{exc.filename}: {exc.strerror}", source("auth", "auth.token_file")) from None
        except ValueError as exc:  # TokenFileError: names the entry's field
            raise InvalidInput(f"{config.auth.token_file}: {exc}", source("auth", "auth.token_file")) from None
    if Path(config.snapshot_dir).exists() and not Path(config.snapshot_dir).is_dir():
        raise InvalidInput(f"{config.snapshot_dir} is not a folder", source("snapshot_dir"))


def check_port(config: ServiceConfig) -> None:
    """Fail fast, in one line, when the HTTP port is taken (Ray Serve's proxy would share a port that another
    service already serves on) or the host is not this machine's."""
    with socket.socket() as probe:
        try:
            probe.bind((config.host, config.port))
        except OSError as exc:
            raise AndromedaError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None


def check_reachable(config: ServiceConfig) -> None:
    """check_port, and fail fast when Redis does not answer."""
    import redis

    try:
        redis.Redis.from_url(config.redis_url, socket_connect_timeout=3).ping()
    except (redis.RedisError, OSError) as exc:
        raise AndromedaError(f"cannot reach Redis at {redact(config.redis_url)}: {redact(exc)}{tls_hint(exc)}") from None
    check_port(config)


SHARD_PROBE = 64  # entries read from the head of each shard stream to tell the shard count they were published for
MAX_SHARDS_PROBED = 256  # streams past the configured shards checked for entries (a larger count published before)


def published_for_other_shards(config: ServiceConfig) -> str | None:
    """Why the shard streams hold ads published for another shard count than config.shards (a replica would set
    them aside as belonging to another shard and serve without them), or None: a stream past the last shard holds
    entries, or one of the first SHARD_PROBE entries of a shard's stream belongs to another shard."""
    import redis

    from andromeda_core.sharding import shard_of
    from index_updater.records import shard_stream

    client = redis.Redis.from_url(config.redis_url)
    pipe = client.pipeline(transaction=False)
    for s in range(config.shards, MAX_SHARDS_PROBED):
        pipe.xlen(shard_stream(config.stream, s))
    beyond = [config.shards + i for i, n in enumerate(pipe.execute(raise_on_error=False))
              if n and not isinstance(n, Exception)]  # a key of another type is not a stream of this service's
    if beyond:
        return f"the stream of shard {beyond[0]} holds entries, past the last of {config.shards}"
    for s in range(config.shards):
        for _, fields in client.xrange(shard_stream(config.stream, s), count=SHARD_PROBE):
            try:
                ad_id = int(fields[b"ad_id"])
            except (KeyError, ValueError):
                continue  # a malformed entry: the replica sets it aside with its own reason
            if shard_of(ad_id, config.shards) != s:
                return (f"ad {ad_id} in the stream of shard {s} belongs to shard {shard_of(ad_id, config.shards)} "
                        f"of {config.shards}")
    return None


def other_shard_count(config: ServiceConfig, start_over: str) -> str | None:
    """What to say when the streams were published for another shard count (published_for_other_shards), or None."""
    why = published_for_other_shards(config)
    return why and (f"{config.shards} shard(s), but the streams at {redact(config.redis_url)} were published for "
                    f"another shard count ({why}): serve them with the shard count they were published for, or "
                    f"{start_over}")


def streams_empty(config: ServiceConfig) -> bool:
    import redis

    from index_updater.records import shard_stream

    client = redis.Redis.from_url(config.redis_url)
    return all(client.xlen(shard_stream(config.stream, s)) == 0 for s in range(config.shards))


def demo_identity(world: Path, model: str, schema: str) -> str:
    """Which demo world `up` publishes, which model embeds its ads and which schema compiles their targeting: the
    model's served name (it names the checkpoint by a digest of its weights) and the schema's tag (schema_tag), which
    the replicas check each entry's against."""
    return f"{world.name} {model} {schema}"


def stale_demo_state(config: ServiceConfig, identity: str) -> bool:
    """Whether up's Redis holds ads published for another demo world, model or schema than `identity` (or by a
    version of up that recorded none, or by anyone else): the shards would dead-letter them, or serve those of
    another world."""
    import redis

    client = redis.Redis.from_url(config.redis_url)
    return not streams_empty(config) and client.get(demo_mark(config)) != identity.encode()


def demo_mark(config: ServiceConfig) -> str:
    """The key that records which demo `up` published to config.stream's streams (demo_identity)."""
    return f"{DEMO_MARK}:{config.stream}"


def demo_world(ads: int) -> Path:
    """A synthetic world of `ads` ads (cached under var/) whose time starts today (UTC), so its ads'
    windows are open now: events, requests, engagements, and an example request for curl."""
    world = Path("var") / f"demo-{ads}"
    if not (world / "truth.npz").exists():
        print(f"synthesising a demo world of {ads} ads and {DEMO_USERS} users in {world}", file=sys.stderr)
        today = int(time.time()) // 86400 * 86400
        synthesize(WorldConfig(ads=ads, users=DEMO_USERS, seed=0, base_time=today), world, load_schema())
        first = json.loads((world / "requests.jsonl").read_text().splitlines()[0])
        (world / "example.json").write_text(json.dumps({**first, "k": 5}, indent=1))
    return world


def served_model(config: ServiceConfig) -> tuple[Schema, object]:
    """The schema and the scorer (ModelScorer, or the hashed two-tower without a model) the config's replicas serve."""
    from andromeda_core.models.serving import load_scorer

    schema = load_schema(config.schema_path)
    with checkpoint("--model", Path(config.model) if config.model else None):
        return schema, load_scorer(config.model, schema)


def publish_demo(config: ServiceConfig, world: Path, schema: Schema, scorer) -> None:
    """The demo world's ad events, compiled under `schema` and embedded by `scorer` (the config's), to its streams, and
    the record of what published them (demo_mark), which `up` reads (until 2026-12-07 `serve --demo-ads` wrote none,
    and every later `up` warned of, or cleared, the same demo's ads)."""
    import redis

    from index_updater.publisher import Publisher
    from index_updater.records import schema_tag

    client = redis.Redis.from_url(config.redis_url)
    publisher = Publisher(client, schema, scorer, shards=config.shards, stream=config.stream)
    events = world / "events.jsonl"
    with tqdm(total=sum(1 for _ in events.open("rb")), unit="event", desc="publish demo ads", file=sys.stderr) as bar:
        publisher.publish_file(events, on_batch=bar.update)
    client.set(demo_mark(config), demo_identity(world, scorer.name, schema_tag(schema)))


class RedisKeeper:
    """`up`'s watch over the redis-server it started. When it dies (killed, by the OOM killer say, or crashed), one line
    says so and it is started again on the same port and data (AOF with fsync always: nothing it acknowledged is
    lost), which is what a local user wants: the shards go on serving meanwhile and their consumers read on by
    themselves, where stopping `up` would take the whole stack down and a new `up` a minute or more to start. A server
    that dies again within `crash_loop_s` of its restart (a full disk, a damaged AOF) or does not start is not tried
    again: `failure` says why and `stopped` is set, so that `up` stops (exit 2); so does anything unexpected in the
    watch itself, rather than leaving `up` serving without a keeper. A server shut down (exit status 0: `redis-cli
    shutdown`) sets `stopped` alone. The server runs in a process group of its own: Ctrl-C stops `up`, whose finally
    stops it."""

    def __init__(self, server, check_s: float = REDIS_CHECK_S, crash_loop_s: float = CRASH_LOOP_S):
        """`server`: the running LocalRedis."""
        self.server, self.check_s, self.crash_loop_s = server, check_s, crash_loop_s
        self.stopped = threading.Event()
        self.failure: str | None = None
        self.restarts = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="redis-keeper", daemon=True)

    def start(self) -> "RedisKeeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before `up` stops the server itself), with one last look: a server that died since the last
        check (whose death may be why `up` stops: a write that failed first) is reported, not started again."""
        self._done.set()
        self._thread.join()
        code = self.server.process.poll()
        if code is not None and not self.stopped.is_set():
            if code == 0:
                self.stopped.set()
            else:
                self._give_up(f"{self._where()} died ({exit_how(code)}); see {self.server.directory / 'redis.log'}")

    def _watch(self) -> None:
        try:
            self._keep()
        except Exception as exc:  # a thread's exception is printed and forgotten: up would serve on unwatched
            self._give_up(f"the watch over redis-server at {self.server.url} failed ({type(exc).__name__}: {exc}); its "
                          f"log is {self.server.directory / 'redis.log'}")

    def _keep(self) -> None:
        restarted_at = None
        while not self._done.wait(self.check_s):
            code = self.server.process.poll()
            if code is None:
                continue
            how, where = exit_how(code), self._where()
            if code == 0:  # asked to shut down
                if not self.stopped.is_set():
                    print(f"{where} was shut down; stopping", file=sys.stderr, flush=True)
                self.stopped.set()
                return
            if restarted_at is not None and time.monotonic() - restarted_at < self.crash_loop_s:
                return self._give_up(f"{where} died again ({how}) {time.monotonic() - restarted_at:.0f} s after its "
                                     f"restart; see {self.server.directory / 'redis.log'}")
            try:
                self.server.restart()
            except (AndromedaError, OSError) as exc:  # LocalRedis's: did not start
                return self._give_up(f"{where} died ({how}) and did not start again: {exc}")
            restarted_at, self.restarts = time.monotonic(), self.restarts + 1
            print(f"{where} died ({how}); started it again on its data (AOF: nothing it acknowledged is lost)",
                  file=sys.stderr, flush=True)

    def _where(self) -> str:
        return f"redis-server at {self.server.url} ({self.server.directory})"

    def _give_up(self, failure: str) -> None:
        self.failure = failure
        self.stopped.set()


def keeper_error(keeper: RedisKeeper) -> AndromedaError:
    return AndromedaError(f"{keeper.failure or 'its redis-server was shut down'}; `up` stopped")


def exit_how(code: int) -> str:
    """A process's end, from its return code: "killed by SIGKILL" or "exit status 1"."""
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit status {code}"


def signal_name(number: int) -> str:
    """SIGKILL; a signal without a name in `signal.Signals` (SIGRTMIN+3, say) by its description and number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number} ({signal.strsignal(number) or 'unknown'})"


def wait_ready(url: str, timeout_s: float = 600, stop: threading.Event | None = None) -> None:
    """Poll /readyz until every shard has caught up (or `stop` is set)."""
    deadline = time.monotonic() + timeout_s
    with tqdm(desc="waiting for /readyz (shards starting and catching up)", file=sys.stderr,
              bar_format="{desc}: {elapsed}") as bar:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
            bar.update(0.5)
    if stop is None or not stop.is_set():
        raise AndromedaError(f"the service at {url} did not become ready within {timeout_s:.0f} s")


def example_body(world: Path | None) -> str:
    """curl's -d argument: the demo world's example request, or a small inline one."""
    if world is not None:
        return shlex.quote(f"@{(world / 'example.json').resolve()}")  # absolute: the curl may run from any folder
    return shlex.quote(json.dumps({"user": {"user_id": 1, "attributes": {"country": "US", "age": 30}}, "k": 5}))


def cli_command() -> str:
    """This `andromeda`, as a command that works from any folder: the script beside this Python (a venv's), else the
    name on PATH."""
    cli = Path(sys.executable).with_name("andromeda")
    return str(cli) if cli.exists() else "andromeda"


def publish_command(config: ServiceConfig, redis_url: str | None) -> str:
    """The `andromeda publish` line for this service's stream, shards and model (and Redis: None leaves it to
    REDIS_URL, which may hold a password), its paths quoted for a shell."""
    words = [cli_command(), "publish", "EVENTS.jsonl", "--stream", config.stream,
             "--shards", str(config.shards)]
    words += ["--redis", redis_url] if redis_url else []
    words += ["--model", str(Path(config.model).resolve())] if Path(config.model).is_file() else []
    return shlex.join(words)


def run_service(config: ServiceConfig, world: Path | None, token_note: str,
                stop: threading.Event | None = None) -> None:
    """Start Ray and the application, wait for readiness, print how to use it, stay up until Ctrl-C (or `stop` is
    set)."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import apply_serve_env

    apply_serve_env()
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines here ("Connecting to existing Serve app
    # ... New http_options will not be applied", after serve.start applied them) alarm more than they tell
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        print(f"starting {config.shards} shard(s) x {config.replicas} replica(s) on Ray Serve ...", file=sys.stderr)
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://{config.host}:{config.port}"
        stop = stop or threading.Event()
        wait_ready(url, stop=stop)
        if not stop.is_set():
            print(f"\nAndromeda is serving at {url}   (OpenAPI: {url}/openapi.json, metrics: {url}/metrics)\n"
                  f"{token_note}\nTry:\n  curl -s {url}/v1/retrieve -H 'Content-Type: application/json' "
                  f"-d {example_body(world)}\n\nCtrl-C stops it.", flush=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    finally:
        print("stopping ... (Ray may log that its Serve controller's shutdown task failed: it was stopped)",
              file=sys.stderr)
        serve.shutdown()
        ray.shutdown()
        print("stopped Ray Serve", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> None:
    settings = load_settings()
    config = service_config(args, settings.redis_url)
    if not config.redis_url:
        raise InvalidInput("REDIS_URL is not set, nor redis_url in --config (`andromeda up` starts a local redis-server "
                           "for you)")
    check_reachable(config)
    if warning := other_shard_count(config, f"republish them to empty streams with `andromeda publish --shards "
                                            f"{config.shards}`"):  # a warning, not a refusal: a few entries of
        print(f"warning: --shards: {warning}", file=sys.stderr)  # another count, dead-lettered since, stay until trimmed
    world = demo_world(args.demo_ads) if args.demo_ads else None
    if world is not None and streams_empty(config):
        publish_demo(config, world, *served_model(config))
    note = "writes: POST /v1/ad-events with Authorization: Bearer $ANDROMEDA_WRITE_TOKEN" if settings.write_token \
        else "writes are disabled (set ANDROMEDA_WRITE_TOKEN to enable POST /v1/ad-events)"
    run_service(config, world, note)


def cached_model_loads(path: Path) -> bool:
    """Whether `path` holds a checkpoint this version of the code loads (an older model version does not)."""
    from andromeda_core.models.retrieval import UNLOADABLE, RetrievalModel

    try:
        RetrievalModel.load(path)
    except UNLOADABLE as exc:
        if path.exists():
            print(f"not using the cached demo model ({str(exc).splitlines()[0]})", file=sys.stderr)
        return False
    return True


def demo_model(world: Path) -> Path:
    """A small MoE trained on the demo world's engagements (cached) -> its path. Loading the
    world's data also keeps its ads' text embeddings in memory, so publishing the demo ads needs no second
    MiniLM pass."""
    from andromeda_core.models.quality import checkpoint_meta
    from andromeda_core.models.recdata import load_synthetic
    from andromeda_core.models.train import TrainConfig, train

    path = world / "moe.safetensors"
    data = load_synthetic(world)
    if cached_model_loads(path):
        return path
    print(f"training the demo MoE on {world} ({DEMO_TRAIN_STEPS} steps)", file=sys.stderr)
    model = train(data, "moe", TrainConfig(steps=DEMO_TRAIN_STEPS))
    model.save(path, checkpoint_meta(data, 0))
    return path


def clear_demo_state(client, snapshot_dir: Path) -> None:
    """Empties up's private Redis and the shards' snapshots: both hold ad vectors embedded by a replaced demo
    model (a replica restores its newest snapshot first, and the republished ads, at the same versions,
    would not replace what it restored)."""
    from index_updater.snapshots import SnapshotStore

    client.flushdb()
    for shard in snapshot_dir.glob("shard-*"):
        for snapshot in SnapshotStore(shard).paths():
            snapshot.unlink()


def cmd_up(args: argparse.Namespace) -> None:
    import redis

    from index_updater.local_redis import LocalRedis
    from index_updater.records import schema_tag

    settings = load_settings()
    from_file = read_config_file(args.config)
    for field in ("redis_url", "snapshot_dir") if not settings.redis_url else ():  # up empties its own redis-server
        if field in from_file:  # and snapshot_dir when they hold another demo's ads
            raise InvalidInput("`andromeda up` keeps its ads in REDIS_URL or a redis-server of its own (which it "
                               "empties, with var/snapshots, when they hold another demo's); serve other ones with "
                               "`andromeda serve`", f"{args.config}: {field}")
    check_port(service_config(args, settings.redis_url or "redis://127.0.0.1:6379/0"))  # bad flags and a taken
    # port fail before any work, and before a second redis-server would open a running one's files
    redis_dir = (Path("var") / "redis").resolve()  # redis-server resolves paths after chdir
    if not settings.redis_url:  # another up's redis-server in this folder (or none installed) refuses before any work
        os.close(LocalRedis(redis_dir).lock())  # (start() takes the lock again, for good)
    world = demo_world(args.demo_ads)
    if args.model is None:
        args.model = demo_model(world)
    token = settings.write_token or secrets.token_urlsafe(16)
    os.environ["ANDROMEDA_WRITE_TOKEN"] = token  # Ray workers inherit it; never written to a config
    server = keeper = None
    redis_url = settings.redis_url
    if not redis_url:
        server = LocalRedis(redis_dir).start()
        redis_url = server.url
        print(f"started redis-server at {redis_url} (data in var/redis)", file=sys.stderr)
        keeper = RedisKeeper(server, REDIS_CHECK_S, CRASH_LOOP_S).start()
    try:
        config = service_config(args, redis_url)
        check_reachable(config)
        schema, scorer = served_model(config)
        identity = demo_identity(world, scorer.name, schema_tag(schema))
        if stale_demo_state(config, identity):
            if server is not None:
                clear_demo_state(redis.Redis.from_url(redis_url), Path(config.snapshot_dir))
                print(f"cleared var/redis and {config.snapshot_dir}: their ads were published for another demo world, "
                      "model or schema", file=sys.stderr)
            else:  # a Redis of the user's: never emptied by up
                print(f"warning: the streams at REDIS_URL hold ads that this demo (world, model, schema) did not "
                      f"publish: up serves them as they are and publishes no demo ads (ads embedded by another model "
                      f"or compiled under another schema are dead-lettered); for the demo's, empty the streams "
                      f"{config.stream}:* or set ANDROMEDA_STREAM to a new name", file=sys.stderr)
        if refusal := other_shard_count(config, f"start over from no ads: delete var/redis and {config.snapshot_dir}"
                                        if server is not None else "republish them to empty streams"):
            raise InvalidInput(refusal, "--shards")
        if streams_empty(config):
            publish_demo(config, world, schema, scorer)
        if keeper is not None and keeper.stopped.is_set():  # died for good (or shut down) while the demo was published
            raise keeper_error(keeper)
        run_service(config, world, f"write token (for POST /v1/ad-events; a new one each run unless ANDROMEDA_WRITE_TOKEN "
                                   f"is set): {token}\nor publish a file of ad events: "
                                   f"{publish_command(config, None if settings.redis_url else redis_url)}",
                    keeper.stopped if keeper is not None else None)
        if keeper is not None and keeper.failure:
            raise keeper_error(keeper)
    except Exception:
        if keeper is not None:
            keeper.stop()  # lets a restart under way finish, so that its failure is known
            if keeper.stopped.is_set():  # the cause (a redis.ConnectionError here is only its symptom)
                raise keeper_error(keeper) from None
        raise
    finally:
        if keeper is not None:
            keeper.stop()
        if server is not None:
            server.stop()


def cmd_serve_config(args: argparse.Namespace) -> None:
    if args.redis is None and "redis_url" in read_config_file(args.config):  # as k8s-config refuses it
        raise InvalidInput("keep the Redis URL (and its password) out of the Serve config: the replicas read REDIS_URL "
                           "from their environment (--redis writes one on purpose)", f"{args.config}: redis_url")
    config = service_config(args, args.redis, check_files=False, redis_source="--redis")  # no --redis: replicas
    # read REDIS_URL
    for warning in cluster_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    text = yaml.safe_dump(config.to_serve_config(), sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")


def cluster_warnings(config: ServiceConfig) -> list[str]:
    """What in a Serve config written for a cluster keeps it local: a loopback host (each node's proxy then listens on
    its own loopback only) and relative paths (each replica resolves them from its own working directory)."""
    warnings = []
    if config.host in ("127.0.0.1", "localhost", "::1"):
        warnings.append(f"host {config.host}: other machines cannot reach the proxies (--host 0.0.0.0 for a cluster)")
    for name, path in (("snapshot_dir", config.snapshot_dir), ("model", config.model),
                       ("schema_path", config.schema_path), ("auth.token_file", config.auth.token_file)):
        if path and not Path(path).is_absolute():
            warnings.append(f"{name} {path} is relative: each replica resolves it from its own working directory")
    return warnings


def add_service_flags(s: argparse.ArgumentParser) -> None:
    from andromeda_core.quantization import STORAGE

    s.add_argument("--config", type=input_file, default=None, help="ServiceConfig YAML; flags override it")
    s.add_argument("--host", default=None, help="HTTP host (default 127.0.0.1)")
    s.add_argument("--port", type=int_in(1, 65535), default=None, help="HTTP port (default 8000)")
    s.add_argument("--shards", type=int_in(1, 1024), default=None, help="index shards (default 1)")
    s.add_argument("--replicas", type=int_in(1, 256), default=None, help="replicas per shard (default 1)")
    s.add_argument("--model", type=Path, default=None, help="trained checkpoint")
    s.add_argument("--storage", choices=sorted(STORAGE), default=None, help="ad vector storage (default fp32)")


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="run the Ray Serve service in the foreground against REDIS_URL")
    add_service_flags(s)
    s.add_argument("--demo-ads", type=int_in(0, WORLD_MAX), default=0,
                   help="synthesise and publish N demo ads when the streams are empty (0: none)")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("up", help="everything local: redis-server, a trained demo model, demo ads, the service")
    add_service_flags(s)
    s.add_argument("--demo-ads", type=int_in(1, WORLD_MAX), default=10000, help="demo corpus size")
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("serve-config", help="write the Ray Serve config YAML (serve run / serve deploy / KubeRay)")
    add_service_flags(s)
    s.add_argument("--redis", default=None, help="Redis URL to put in the config (default: none; the replicas then read their own REDIS_URL)")
    s.add_argument("--out", type=Path, default=None, help="file to write (default: stdout)")
    s.set_defaults(func=cmd_serve_config)
