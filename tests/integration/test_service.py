"""The service over HTTP: a real local Ray Serve (2 CPUs) and a real redis-server, started once per
session. Two applications run side by side over the same corpus: one shard (/one) and two (/two)."""
from __future__ import annotations

import gzip
import json
import time
from types import SimpleNamespace

import pytest
import ray
import redis
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from ray import serve
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.quality import checkpoint_meta
from andromeda_core.models.recdata import load_synthetic
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.train import TrainConfig, train
from andromeda_core.retriever import Retriever
from andromeda_core.schema import load_schema
from andromeda_core.sharding import shard_of
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request
from deployments.app import build_app
from deployments.config import ServiceConfig, by_reference
from tests.integration.conftest import WRITE_TOKEN as TOKEN, deployed, eventually
from index_updater.publisher import Publisher
from index_updater.snapshots import stream_id_key
from tests.conftest import upsert

NOW = 1_767_000_000


@pytest.fixture(scope="module")
def service(tmp_path_factory, session_redis_url, ray_serve):
    """A tiny trained MoE over a 600-ad synthetic world, and two applications over that corpus on the session's Ray
    Serve: /one with one shard and /two with two."""
    tmp, url = tmp_path_factory.mktemp("service"), session_redis_url
    world = tmp / "world"
    # Its time starts 12 days from now: every ad's window ends after now, so no replica sweeps an ad
    # that the offline index (which never sweeps) still holds for history lookups.
    base_time = (int(time.time()) // 86400 + 12) * 86400
    synthesize(WorldConfig(ads=600, users=12, seed=3, base_time=base_time), world, load_schema())
    data = load_synthetic(world)
    model = tmp / "moe.safetensors"
    train(data, "moe", TrainConfig(steps=3, batch=16, negatives=16), progress=False).save(model, checkpoint_meta(data, 0))
    schema, apps = load_schema(), {}
    for name, shards in (("one", 1), ("two", 2)):
        config = ServiceConfig(redis_url=url, stream=f"test-{name}", shards=shards, model=str(model),
                               snapshot_dir=str(tmp / name), snapshot_every_s=1, shard_cpus=0.1, router_cpus=0.1,
                               shard_timeout_s=3)
        Publisher(redis.Redis.from_url(url), schema, ModelScorer.load(model, schema), shards=shards,
                  stream=config.stream).publish_file(world / "events.jsonl")
        apps[name] = build_app(config)
    with deployed(apps):
        yield SimpleNamespace(url=ray_serve, world=world, model=model, redis=redis.Redis.from_url(url))


@pytest.fixture(scope="module")
def offline(service):
    """The same corpus in one process, answered by the offline retriever (what `andromeda retrieve` runs)."""
    schema = load_schema()
    scorer = ModelScorer.load(service.model, schema)
    index = AdIndex(schema, scorer.dim)
    load_events(index, schema, scorer, read_events(service.world / "events.jsonl"))
    return Retriever(index, scorer)


def world_requests(service, k: int = 20) -> list[dict]:
    lines = (service.world / "requests.jsonl").read_text().splitlines()
    return [{**json.loads(line), "k": k} for line in lines]


def post(url: str, body, token: str | None = None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(url, data=json.dumps(body), headers={"Content-Type": "application/json", **headers},
                         timeout=30, **kwargs)


def answer(response) -> list[tuple[int, float]]:
    return [(a.ad_id, a.score) for a in response.ads] if hasattr(response, "ads") else \
        [(a["ad_id"], a["score"]) for a in response["ads"]]


def same_answer(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """The same ads in the same order with the same scores up to float32 rounding (the service's
    workers run torch with another thread count than this process, so sums may round differently: relatively, and
    absolutely for scores near 0, whose terms are not)."""
    return [i for i, _ in got] == [i for i, _ in want] and \
        [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-5, abs=1e-6)


def redis_now(client: redis.Redis) -> tuple[int, int]:
    """Redis's clock as a stream id key: no watermark may pass it."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000, 0


def test_http_answers_exactly_what_offline_retrieve_answers(service, offline):
    bodies = world_requests(service)
    for body in bodies:
        got = post(f"{service.url}/one/v1/retrieve", body)
        assert got.status_code == 200, got.text
        want = offline.retrieve([parse_request(body)])[0]
        assert same_answer(answer(got.json()), answer(want)) and got.json()["eligible"] == want.eligible
        newest = service.redis.xinfo_stream("test-one:0")["last-generated-id"].decode()
        mark = got.json()["index_watermark"]  # caught up: past the newest entry, up to Redis's clock
        assert mark == got.json()["shard_watermarks"][0] and stream_id_key(newest) <= stream_id_key(mark) <= redis_now(service.redis)
    assert any(answer(offline.retrieve([parse_request(b)])[0]) for b in bodies)  # not all empty


def test_two_shards_merge_to_the_single_shard_answer(service):
    bodies = world_requests(service, k=50)
    one = post(f"{service.url}/one/v1/retrieve:batch", bodies).json()["responses"]
    two = post(f"{service.url}/two/v1/retrieve:batch", bodies).json()["responses"]
    assert all(same_answer(answer(a), answer(b)) for a, b in zip(one, two, strict=True))
    assert [r["eligible"] for r in one] == [r["eligible"] for r in two]
    assert all(len(r["shard_watermarks"]) == 2 for r in two)


def test_a_batch_past_the_shards_batch_size_at_the_largest_k_answers_as_offline(service, offline):
    """48 requests (past max_batch_size: the shards' search_alone) at k = 10,000 (every eligible ad)."""
    bodies = (world_requests(service, k=10000) * 48)[:48]
    want = [answer(r) for r in offline.retrieve([parse_request(b) for b in bodies])]
    for app in ("one", "two"):
        got = post(f"{service.url}/{app}/v1/retrieve:batch", bodies)
        assert got.status_code == 200, got.text[:300]
        assert all(same_answer(answer(g), w) for g, w in zip(got.json()["responses"], want, strict=True))


@serve.deployment(ray_actor_options={"num_cpus": 0.05})
class Echo:
    def size(self, payload: bytes) -> int:
        return len(payload)

    def blob(self, size: int) -> bytes:
        return b"x" * size


@serve.deployment(ray_actor_options={"num_cpus": 0.05})
class Sender:
    """Calls Echo as the router calls its shards (a handle made by the deploying process, by_reference() set)."""

    def __init__(self, echo):
        self.echo = echo.options(_by_reference=by_reference())

    async def __call__(self, size: int) -> tuple[int, int]:
        return await self.echo.size.remote(b"x" * size), len(await self.echo.blob.remote(size))


def test_calls_between_replicas_go_by_grpc_and_carry_messages_past_4_mib(service):
    """SERVE_ENV: the router's calls to its shards go by gRPC, whose messages are capped at 4 MiB unless raised (a
    shard's answer to a retrieve:batch of 256 requests at k = 10,000 over a large table is about 30 MB)."""
    assert not by_reference()  # this process has SERVE_ENV too (local_ray), as the replicas do
    sender = serve.run(Sender.bind(Echo.bind()), name="grpc", route_prefix="/grpc")
    try:
        assert sender.remote(5 << 20).result(timeout_s=60) == (5 << 20, 5 << 20)
    finally:
        serve.delete("grpc")


def retrieved(service, app: str, ad_id: int, attributes: dict) -> bool:
    body = {"user": {"user_id": 1, "attributes": attributes}, "context": {"ts": NOW}, "k": 10000}
    return ad_id in [a["ad_id"] for a in post(f"{service.url}/{app}/v1/retrieve", body).json()["ads"]]




def test_published_ads_are_servable_and_removable_within_two_seconds(service):
    ad_id, who = 900_001, {"country": "IS", "age": 40}
    event = upsert(ad_id, 1, {"country": {"any_of": ["IS"]}}, title="Glacier hiking tours")
    assert post(f"{service.url}/two/v1/ad-events", [event]).status_code == 401
    assert post(f"{service.url}/two/v1/ad-events", [event], token="wrong").status_code == 401
    published = post(f"{service.url}/two/v1/ad-events", [event], token=TOKEN)
    assert published.status_code == 200 and len(published.json()["ids"]) == 1
    assert eventually(lambda: retrieved(service, "two", ad_id, who))
    state = requests.get(f"{service.url}/two/v1/ads/{ad_id}", timeout=10).json()
    assert state["version"] == 1 and state["shard"] == shard_of(ad_id, 2) and state["servable_now"] is True
    head = requests.head(f"{service.url}/two/v1/ads/{ad_id}", timeout=10)
    assert head.status_code == 200 and head.content == b""
    post(f"{service.url}/two/v1/ad-events", [{"op": "pause", "ad_id": ad_id, "version": 2}], token=TOKEN)
    assert eventually(lambda: not retrieved(service, "two", ad_id, who))
    assert requests.get(f"{service.url}/two/v1/ads/{ad_id}", timeout=10).json()["servable_now"] is False
    post(f"{service.url}/two/v1/ad-events", [{"op": "resume", "ad_id": ad_id, "version": 3}], token=TOKEN)
    assert eventually(lambda: retrieved(service, "two", ad_id, who))
    post(f"{service.url}/two/v1/ad-events", [{"op": "delete", "ad_id": ad_id, "version": 4}], token=TOKEN)
    assert eventually(lambda: not retrieved(service, "two", ad_id, who))
    assert requests.get(f"{service.url}/two/v1/ads/{ad_id}", timeout=10).status_code == 404
    assert requests.head(f"{service.url}/two/v1/ads/{ad_id}", timeout=10).status_code == 404


@pytest.mark.parametrize("path, body, field", [
    ("/v1/retrieve", {"user": {"user_id": -1}}, "user.user_id"),
    ("/v1/retrieve", {"user": {"user_id": 1, "attributes": {"shoe_size": 42}}}, "user.attributes.shoe_size"),
    ("/v1/retrieve", {"user": {"user_id": 1}, "k": 0}, "k"),
    ("/v1/retrieve", {"user": {"user_id": 1, "history": [{"ad_id": 1, "event": "poke", "ts": 1}]}}, "user.history[0].event"),
    ("/v1/retrieve", [], "body"),
    ("/v1/retrieve:batch", [{"user": {"user_id": 1}}, {"user": {"user_id": 2, "attributes": {"age": [20, 30]}}}],
     "[1].user.attributes.age"),
    ("/v1/retrieve:batch", [], "body"),
])
def test_malformed_requests_get_422_naming_the_field(service, path, body, field):
    got = post(f"{service.url}/two{path}", body)
    assert got.status_code == 422, got.text
    assert got.json()["error"]["field"] == field


def stream_lengths(service) -> list[int]:
    return [service.redis.xlen(f"test-two:{s}") for s in (0, 1)]


def test_bad_events_get_422_naming_index_and_field_and_publish_nothing(service):
    before = stream_lengths(service)
    events = [upsert(900_100, 1), upsert(900_101, 1, {"country": {"any_of": ["XX"]}}), upsert(900_102, 1)]
    got = post(f"{service.url}/two/v1/ad-events", events, token=TOKEN)
    assert got.status_code == 422 and got.json()["error"]["field"] == "[1].ad.targeting.country.any_of[0]"
    bad_bid = [upsert(900_103, 1), {**upsert(900_104, 1), "ad": {**upsert(900_104, 1)["ad"], "bid": -1}}]
    got = post(f"{service.url}/two/v1/ad-events", bad_bid, token=TOKEN)
    assert got.status_code == 422 and got.json()["error"]["field"] == "[1].ad.bid"
    got = post(f"{service.url}/two/v1/ad-events", [{"op": "explode", "ad_id": 1}], token=TOKEN)
    assert got.status_code == 422 and got.json()["error"]["field"] == "[0].op"
    twice = json.dumps([upsert(900_105, 1)]).replace('"ad_id": 900105', '"ad_id": 900105, "ad_id": 900106', 1)
    got = requests.post(f"{service.url}/two/v1/ad-events", data=twice, timeout=10,
                        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    assert got.status_code == 422 and 'the key "ad_id" appears twice' in got.json()["error"]["message"], got.text
    assert stream_lengths(service) == before
    for ad_id in (900_100, 900_102, 900_103):
        assert requests.get(f"{service.url}/two/v1/ads/{ad_id}", timeout=10).status_code == 404


def test_raw_garbage_is_a_422_not_a_500(service):
    for body in (b"{", b"\xff\xfe", b"null", b"[1, 2]", b'{"user": null}'):
        got = requests.post(f"{service.url}/two/v1/retrieve", data=body, headers={"Content-Type": "application/json"},
                            timeout=10)
        assert got.status_code == 422, (body, got.status_code, got.text)
    nested = b"[" * 5000 + b"]" * 5000
    long_number = b'{"user": {"user_id": ' + b"9" * 5000 + b"}}"  # past Python's 4,300 digits
    for body in (nested, long_number):
        got = requests.post(f"{service.url}/two/v1/retrieve", data=body, headers={"Content-Type": "application/json"},
                            timeout=10)
        assert got.status_code == 422 and got.json()["error"]["field"] == "body", (body[:40], got.status_code, got.text)
        assert "4,300 digits" in got.json()["error"]["message"]
    for body, why in ((b'{"user": {"user_id": 1, "attributes": {"country": "\xff\xfe"}}}', "not UTF-8 at byte 51"),
                      ('{"user": {"user_id": 1}}'.encode("utf-16"), "not UTF-8 at byte 0"),
                      (b'{"user": {"user_id": 1}, "k": 5, "k": 5000}', 'the key "k" appears twice')):
        got = requests.post(f"{service.url}/two/v1/retrieve", data=body, headers={"Content-Type": "application/json"},
                            timeout=10)
        assert got.status_code == 422 and got.json()["error"]["field"] == "body", (body[:40], got.status_code, got.text)
        assert why in got.json()["error"]["message"]
    for path in ("/v1/retrieve", "/v1/retrieve:batch"):
        empty = requests.post(f"{service.url}/two{path}", data=b"", headers={"Content-Type": "application/json"},
                              timeout=10)
        assert empty.status_code == 422 and empty.json()["error"]["field"] == "body"
        assert "the body is empty" in empty.json()["error"]["message"]
    bad_id = requests.get(f"{service.url}/two/v1/ads/abc", timeout=10)
    assert bad_id.status_code == 422 and bad_id.json()["error"]["field"] == "ad_id"
    assert requests.get(f"{service.url}/two/v1/ads/-5", timeout=10).status_code == 422
    for other_spelling in ("00001", "+1", "1.0"):  # not read as ad 1
        got = requests.get(f"{service.url}/two/v1/ads/{other_spelling}", timeout=10)
        assert got.status_code == 422 and got.json()["error"]["field"] == "ad_id", (other_spelling, got.text)
    as_text = requests.post(f"{service.url}/two/v1/retrieve", data='{"user": {"user_id": 1}}',
                            headers={"Content-Type": "text/plain"}, timeout=10)
    assert as_text.status_code == 415 and as_text.json()["error"]["field"] == "Content-Type"
    gzipped = requests.post(f"{service.url}/two/v1/retrieve", data=gzip.compress(b'{"user": {"user_id": 1}}'),
                            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=10)
    assert gzipped.status_code == 415 and gzipped.json()["error"]["field"] == "Content-Encoding", gzipped.text
    for encoding in ("gzip", "br", "identity, gzip"):  # refused whatever the bytes hold, not read as if plain
        labelled = requests.post(f"{service.url}/two/v1/retrieve", data='{"user": {"user_id": 1}}',
                                 headers={"Content-Type": "application/json", "Content-Encoding": encoding}, timeout=10)
        assert labelled.status_code == 415 and labelled.json()["error"]["field"] == "Content-Encoding", labelled.text
    plain = requests.post(f"{service.url}/two/v1/retrieve", data='{"user": {"user_id": 1}}',
                          headers={"Content-Type": "application/json", "Content-Encoding": "Identity "}, timeout=10)
    assert plain.status_code == 200, plain.text
    too_large = requests.get(f"{service.url}/two/v1/ads/{2**63}", timeout=10)
    assert too_large.status_code == 422 and str(2**63) in too_large.json()["error"]["message"]  # not a float's 9...6000
    for json_type in ("APPLICATION/JSON", "application/vnd.andromeda+json; charset=utf-8"):  # JSON to FastAPI too
        malformed = requests.post(f"{service.url}/two/v1/retrieve", data="not json", headers={"Content-Type": json_type},
                                  timeout=10)
        assert malformed.status_code == 422 and malformed.json()["error"]["field"] == "body", (json_type, malformed.text)
        fine = requests.post(f"{service.url}/two/v1/retrieve", data='{"user": {"user_id": 1}}',
                             headers={"Content-Type": json_type}, timeout=10)
        assert fine.status_code == 200, (json_type, fine.text)
    for method, path, status in (("GET", "/v1/retrieve", 405), ("DELETE", "/v1/ads/5", 405), ("GET", "/v2/nothing", 404),
                                 ("POST", "/v1/retrieve/", 404), ("GET", "/v1/ads/5/", 404)):  # no redirect built
        got = requests.request(method, f"{service.url}/two{path}", timeout=10, allow_redirects=False,  # from Host
                               headers={"Host": "elsewhere.example"})
        assert got.status_code == status and set(got.json()["error"]) == {"category", "field", "message"}, path


def test_health_readiness_and_metrics(service):
    assert requests.get(f"{service.url}/two/healthz", timeout=10).status_code == 200
    for path in ("healthz", "readyz", "metrics"):  # a load balancer's HEAD check: the status, no body
        head = requests.head(f"{service.url}/two/{path}", timeout=10)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    ready = requests.get(f"{service.url}/two/readyz", timeout=10)
    assert ready.status_code == 200 and [s["shard"] for s in ready.json()["shards"]] == [0, 1]
    assert all(s["errors"] == 0 and s["last_error"] == "" and s["reason"] == "ok" for s in ready.json()["shards"])
    served = ModelScorer.load(service.model, load_schema()).name  # the checkpoint each replica serves, by digest
    assert served.startswith("moe-v") and [s["model"] for s in ready.json()["shards"]] == [served, served]
    found = post(f"{service.url}/two/v1/retrieve", world_requests(service)[0]).json()["ads"][0]["ad_id"]
    post(f"{service.url}/two/v1/retrieve", {"user": {"user_id": "x"}})
    post(f"{service.url}/two/v1/ad-events", [upsert(1)], token="wrong")
    assert requests.get(f"{service.url}/two/v1/ads/{found}", timeout=10).status_code == 200
    delete = {"op": "delete", "ad_id": 424242, "version": 1}  # an id no test indexes: a tombstone, harmless
    assert post(f"{service.url}/two/v1/ad-events", [delete], token=TOKEN).status_code == 200
    text = requests.get(f"{service.url}/two/metrics", timeout=10).text
    for name in ('andromeda_request_seconds_count{endpoint="retrieve",stage="user_towers"}',
                 'andromeda_request_seconds_count{endpoint="ad",stage="total"}', 'andromeda_requests_total{endpoint="ad"}',
                 'andromeda_request_seconds_count{endpoint="ad_events",stage="total"}',
                 'andromeda_shard_index_size{shard="1"}', 'andromeda_shard_lag_seconds{shard="0"}',
                 'andromeda_shard_dead_letters{shard="0"}', "andromeda_eligible_ads_total",
                 'andromeda_errors_total{cause="invalid_input"}', 'andromeda_errors_total{cause="unauthorized"}'):
        assert name in text, name


def test_killed_replica_is_replaced_and_catches_up(service):
    bodies = world_requests(service, k=30)
    before = [answer(r) for r in post(f"{service.url}/one/v1/retrieve:batch", bodies).json()["responses"]]
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::one#shard-0#"))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    statuses = [post(f"{service.url}/one/v1/retrieve:batch", bodies).status_code for _ in range(5)]
    assert set(statuses) <= {200, 503}
    assert eventually(lambda: post(f"{service.url}/one/v1/retrieve:batch", bodies).status_code == 200, 120)
    after = [answer(r) for r in post(f"{service.url}/one/v1/retrieve:batch", bodies).json()["responses"]]
    assert all(same_answer(a, b) for a, b in zip(after, before, strict=True))


def test_openapi_is_served(service):
    spec = requests.get(f"{service.url}/two/openapi.json", timeout=10).json()
    assert {"/v1/retrieve", "/v1/retrieve:batch", "/v1/ad-events", "/v1/ads/{ad_id}", "/healthz", "/readyz",
            "/metrics"} <= set(spec["paths"])
    assert all("415" in spec["paths"][path]["post"]["responses"] for path in ("/v1/retrieve", "/v1/retrieve:batch",
                                                                              "/v1/ad-events"))
    assert all("401" in operation["responses"] for path, item in spec["paths"].items() if path.startswith("/v1")
               for operation in item.values())  # a wrong token is refused on reads too
    assert serve.status().applications["two"].status == "RUNNING"


# -- fuzzing (runs last: it publishes random ads to /two) --------------------------------------------

FUZZ_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
CASES_PER_OPERATION = 30


def test_fuzzed_requests_get_no_5xx_and_responses_match_the_schema(service):
    """schemathesis generates requests from the running service's OpenAPI (a bounded number per
    operation, with the write token so event publishing is fuzzed too) and checks every response."""
    schema = schemathesis.openapi.from_url(f"{service.url}/two/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=CASES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def fuzz(case):
            case.call_and_validate(base_url=f"{service.url}/two", headers={"Authorization": f"Bearer {TOKEN}"},
                                   checks=FUZZ_CHECKS, timeout=30)

        fuzz()
