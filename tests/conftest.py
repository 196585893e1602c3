from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter, chosen before any module defines one
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import speed_up_interpreter

    speed_up_interpreter()

from andromeda_cli.main import main
from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.schema import load_schema, schema_from_dict
from andromeda_core.types import parse_event

SMALL_SCHEMA = {
    "name": "small-test",
    "version": 1,
    "categories": [
        {"name": "country", "kind": "enum", "vocabulary": ["US", "CA", "GB", "DE", "FR"]},
        {"name": "age", "kind": "ordinal", "range": [13, 20]},
        {"name": "interests", "kind": "enum", "multi": True, "max_groups": 3,
         "vocabulary": [f"i{n}" for n in range(40)]},
        {"name": "topics", "kind": "enum", "multi": True, "max_values": 4, "max_groups": 2,
         "vocabulary": [f"t{n}" for n in range(300)]},
        {"name": "city", "kind": "enum", "max_values": 3, "vocabulary": [f"c{n}" for n in range(300)]},
        {"name": "audiences", "kind": "id", "multi": True, "cardinality": 50, "max_values": 4, "max_groups": 2},
        {"name": "surface", "kind": "enum", "source": "context", "vocabulary": ["feed", "stories", "reels"]},
    ],
}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]):
    """The tests on the session's Ray Serve (tests/integration/conftest.py: ray_serve) run last, each module's together
    as collected: Ray starts once and stays up beside no other test. After every other reordering (--ff, --nf), so
    that none splits a module and sets its fixture up twice."""
    yield
    items.sort(key=lambda item: "ray_serve" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def small_schema():
    return schema_from_dict(SMALL_SCHEMA)


@pytest.fixture(scope="session")
def default_schema():
    return load_schema()


@pytest.fixture(scope="session")
def scorer():
    return HashedTwoTower(dim=16, buckets=4096)


def make_ad(ad_id: int, version: int = 1, targeting: dict | None = None, **fields) -> dict:
    return {"ad_id": ad_id, "advertiser_id": 1, "version": version,
            "creative": {"title": fields.pop("title", f"ad {ad_id}")}, "bid": fields.pop("bid", 1.0),
            "targeting": targeting or {}, **fields}


def failing_write(monkeypatch, on_call: int, meanwhile=lambda: None) -> None:
    """Tensor writes (`t[key] = value`) fail from call number on_call on with RuntimeError("device write failed"),
    meanwhile() running just before the failure (e.g. another thread's read); undone with monkeypatch."""
    setitem, calls = torch.Tensor.__setitem__, [0]

    def write(self, key, value):
        calls[0] += 1
        if calls[0] == on_call:
            meanwhile()
            raise RuntimeError("device write failed")
        return setitem(self, key, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", write)


def wait_until(condition, seconds: float = 10.0) -> bool:
    """Poll `condition` until it holds or `seconds` pass (a bound against hanging, not a timing claim)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def run_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `andromeda ARGV` run in process (the CLI's refusals, without a Python and
    torch start per case)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def upsert(ad_id: int, version: int = 1, targeting: dict | None = None, **fields) -> dict:
    return {"op": "upsert", "ad": make_ad(ad_id, version, targeting, **fields)}


def apply_events(index: AdIndex, scorer, events: list[dict]) -> list[bool]:
    return index.apply(prepare_ops(index.schema, scorer, [parse_event(e) for e in events]))
