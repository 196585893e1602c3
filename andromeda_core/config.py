"""Typed configuration: the project's own environment variables (ANDROMEDA_*, REDIS_URL) are read here; the few
that configure one module alone are read there (ANDROMEDA_CXXFLAGS and CXX in kernels/cpu.py, XDG_CACHE_HOME for the
kernels' build cache, the Ray Serve settings in deployments/config.py)."""
from __future__ import annotations

import logging
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from andromeda_core.errors import InvalidInput, shown
from andromeda_core.schema import DEFAULT_SCHEMA_PATH

REPO_ROOT = Path(__file__).resolve().parent.parent


# user:password@ in any URL, and password=... in a query string (redis-py reads both)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^@/\s'\"]*@")
_QUERY_PASSWORD = re.compile(r"(?P<key>\bpassword=)[^&\s'\"]*", re.IGNORECASE)


def redact(text: object) -> str:
    """`str(text)` with the credentials of every URL in it replaced by `***` (Redis URLs carry passwords:
    no message, log line or error body may show them)."""
    text = _URL_CREDENTIALS.sub(r"\g<scheme>***@", str(text))
    return _QUERY_PASSWORD.sub(r"\g<key>***", text)


def tls_hint(exc: BaseException) -> str:
    """What to fix when a Redis connection error came from the URL's TLS settings (redis-py keeps the cause
    in `__context__`), else ""."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return " (the server's TLS certificate was not trusted: name its CA with ssl_ca_certs=<path> in the URL)"
    if isinstance(cause, FileNotFoundError):
        return " (a file the URL names does not exist: ssl_ca_certs, ssl_certfile, ssl_keyfile or a unix socket path)"
    return ""


_base_factory = logging.getLogRecordFactory()


def _redacting_factory(*args, **kwargs) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    message = record.getMessage()
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        if redact(text) != text:
            record.exc_text = redact(text)
    return record


def install_log_redaction() -> None:
    """Redact URL credentials in every log record this process creates (idempotent)."""
    if logging.getLogRecordFactory() is not _redacting_factory:
        logging.setLogRecordFactory(_redacting_factory)


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise InvalidInput(f"must be an integer in [{lo}, {hi}], got {shown(raw)}", name)
    return value


def _env_text(name: str, default: str) -> str:
    raw = os.environ.get(name, default)
    if not raw.strip():
        raise InvalidInput("must not be empty (unset it for the default)", name)
    return raw


STREAM_MAX_CHARS = 200  # a stream's base name (shard s reads `<name>:<s>`), wherever it is given


def stream_problem(name: str) -> str | None:
    """Why `name` cannot be the update streams' base name, or None."""
    if not name.strip():
        return "must not be empty"
    return f"at most {STREAM_MAX_CHARS} characters, got {len(name)}" if len(name) > STREAM_MAX_CHARS else None


def _env_secret(name: str) -> str | None:
    """A credential from the environment without outer whitespace (a Secret made from a file ends in a line ending,
    and no HTTP header or URL carries any); None when unset or blank."""
    return os.environ.get(name, "").strip() or None


def _env_device(name: str, default: str) -> str:
    """A torch device name; whether this machine has it is checked where a table is built."""
    import torch

    raw = os.environ.get(name, default)
    try:
        kind = torch.device(raw).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):  # the kernels run on these two (meta, mps and the rest fail in the scan)
        raise InvalidInput(f"must be cpu or a CUDA device (cpu, cuda, cuda:1, ...), got {shown(raw)}", name)
    return raw


@dataclass(frozen=True)
class IndexConfig:
    """How a replica lays out and scans its ad table."""

    initial_capacity: int = 1024
    """Slots allocated up front; the table doubles when full."""
    rescore: int = 2
    """The fused pass shortlists rescore * k slots per request and the scorer rescores them (with fp16/int8
    storage, from an exact float32 copy) (ANDROMEDA_RESCORE); 0 keeps no copy: the shortlist is k and its
    scores come from the stored vectors."""


@dataclass(frozen=True)
class Settings:
    schema_path: Path = DEFAULT_SCHEMA_PATH
    """Targeting schema YAML (ANDROMEDA_SCHEMA)."""
    device: str = "cpu"
    """Torch device of the ad table (ANDROMEDA_DEVICE): cpu, cuda, cuda:1, ..."""
    index: IndexConfig = field(default_factory=IndexConfig)
    redis_url: str | None = None
    """Redis holding the updates stream (REDIS_URL); unset: `andromeda` starts a local redis-server."""
    stream: str = "andromeda:ad-events"
    """Name of the updates stream (ANDROMEDA_STREAM); dead letters go to `<stream>:dead-letters`."""
    shards: int = 1
    """Index shards the ads are split over by hash(ad_id) % shards (ANDROMEDA_SHARDS)."""
    cache_dir: Path = Path(".cache")
    """Derived data kept between runs: text embeddings, benchmark worlds (ANDROMEDA_CACHE)."""
    movielens_dir: Path = REPO_ROOT.parent / "shared" / "data" / "ml-latest-small"
    """MovieLens ml-latest-small CSVs (ANDROMEDA_MOVIELENS)."""
    write_token: str | None = field(default=None, repr=False)
    """Bearer token that POST /v1/ad-events requires (ANDROMEDA_WRITE_TOKEN); unset: writes are refused."""


def load_settings() -> Settings:
    index = IndexConfig(
        initial_capacity=_env_int("ANDROMEDA_INITIAL_CAPACITY", 1024, 1, 1 << 31),
        rescore=_env_int("ANDROMEDA_RESCORE", 2, 0, 64),
    )
    return Settings(
        schema_path=Path(_env_text("ANDROMEDA_SCHEMA", str(DEFAULT_SCHEMA_PATH))),  # read where it is used: a
        # Serve config names a file of the machines it runs on
        device=_env_device("ANDROMEDA_DEVICE", "cpu"),
        index=index,
        redis_url=_env_secret("REDIS_URL"),
        stream=_env_text("ANDROMEDA_STREAM", "andromeda:ad-events"),
        shards=_env_int("ANDROMEDA_SHARDS", 1, 1, 1024),  # as ServiceConfig.shards: publish no count the service
        # cannot run
        cache_dir=Path(os.environ.get("ANDROMEDA_CACHE") or ".cache"),  # empty: the default, not the working folder
        movielens_dir=Path(os.environ.get("ANDROMEDA_MOVIELENS") or Settings.movielens_dir),
        write_token=_env_secret("ANDROMEDA_WRITE_TOKEN"),
    )
