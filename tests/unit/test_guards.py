"""Token store, token file, token buckets, request limits and credential redaction (no Ray, no Redis)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from andromeda_core.config import install_log_redaction, load_settings, redact
from andromeda_core.errors import AndromedaError, InvalidInput, RateLimited
from andromeda_core.types import parse_request
from deployments.auth import ENV_ADMIN, TokenFileError, TokenStore, add_token, new_token, parse_token_file
from deployments.config import Limits
from deployments.api import ECHOED_CHARS, GuardSettings, create_app, error_response
from deployments import api, limits
from deployments.limits import Admission, LatencyShedder, TokenBuckets, check_requests, past_wire_bound, retry_after


def test_tokens_verify_by_role_and_the_file_holds_no_token(tmp_path):
    path = tmp_path / "tokens.json"
    acme = add_token(path, "acme", "advertiser", 7)
    viewer = add_token(path, "viewer", "reader")
    assert acme not in path.read_text() and acme.split(".")[1] not in path.read_text()
    store = TokenStore("the-admin-token", str(path))
    assert store.verify("the-admin-token") is ENV_ADMIN
    assert store.verify(acme).advertiser_id == 7 and store.verify(acme).can_write
    assert store.verify(viewer).role == "reader" and not store.verify(viewer).can_write
    for wrong in ("", "the-admin-token ", acme[:-1], acme + "A", "viewer." + acme.split(".")[1], "nobody.x", "."):
        assert store.verify(wrong) is None, wrong
    assert TokenStore(None, None).verify("") is None and not TokenStore(None, None).writes_enabled


def test_a_changed_file_is_reloaded_and_a_broken_one_keeps_the_old_tokens(tmp_path):
    path = tmp_path / "tokens.json"
    acme = add_token(path, "acme", "advertiser", 7)
    store = TokenStore(None, str(path), reload_s=0)
    globex = add_token(path, "globex", "advertiser", 8)
    assert store.verify(globex).advertiser_id == 8
    path.write_text("{")
    assert store.verify(acme) is not None and store.reload_errors == 1
    path.write_text(json.dumps({"tokens": []}))
    assert store.verify(acme) is None
    path.write_text("[]")
    with pytest.raises(TokenFileError):
        TokenStore(None, str(path))  # at start a bad file is a failed start


@pytest.mark.parametrize("entry, field", [
    ({"name": "a b"}, "tokens[0].name"),
    ({"role": "root"}, "tokens[0].role"),
    ({"advertiser_id": "7"}, "tokens[0].advertiser_id"),
    ({"salt": "zz"}, "tokens[0]"),
    ({"hash": "00"}, "tokens[0]"),
    ({"name": "acme\n"}, "tokens[0].name"),  # a final newline: no HTTP header carries the token
    ({"expires": 0}, "tokens[0].expires"),  # unknown: refused, not ignored
])
def test_a_bad_token_file_names_the_field(entry, field):
    good = new_token("acme", "advertiser", 7)[1]
    with pytest.raises(TokenFileError) as info:
        parse_token_file(json.dumps({"tokens": [{**good, **entry}]}))
    assert info.value.field == field
    with pytest.raises(TokenFileError, match="duplicate"):
        parse_token_file(json.dumps({"tokens": [good, good]}))


def test_a_token_file_naming_a_key_twice_is_refused():
    """{"role": "reader", "role": "admin"} would be an admin token to json.loads (the last value wins)."""
    good = json.dumps(new_token("acme", "reader")[1])
    twice = good.replace('"role": "reader"', '"role": "reader", "role": "admin"')
    assert twice != good
    for text in ('{"tokens": [%s]}' % twice, '{"tokens": [%s], "tokens": []}' % good, '{"tokens": [], "extra": 1}',
                 '{"tokens": [%s]}' % good.replace('"role"', '"advertiser_id": %s, "role"' % ("9" * 5001))):
        with pytest.raises(TokenFileError):
            parse_token_file(text)
    with pytest.raises(ValueError):
        new_token("acme\n", "reader")


def test_token_bucket_allows_a_burst_then_refills_and_stays_bounded():
    buckets = TokenBuckets(rate=2.0, burst=3, callers=2)
    assert [buckets.take("a", now=0.0) for _ in range(3)] == [0, 0, 0]
    assert buckets.take("a", now=0.0) == pytest.approx(0.5)
    assert buckets.take("a", now=0.5) == 0  # one token back after 1/rate s
    assert buckets.take("b", now=0.5) == 0 and buckets.take("c", now=0.5) == 0
    assert len(buckets._buckets) == 2  # "a", the least recently seen, was dropped
    assert retry_after(0.01) == "1" and retry_after(2.2) == "3"
    assert retry_after(1e300) == retry_after(float("inf")) == "86400"  # a day at most, never a 300-digit header


REFUSED, PROBE = Admission.REFUSED, Admission.PROBE


def test_latency_shedder_refuses_new_requests_while_a_queue_stands():
    shed = LatencyShedder(target_s=0.5, interval_s=1.0)
    shed.done(0.9, now=10.0)
    shed.done(0.7, now=10.5)
    assert shed.admit(inflight=3, now=10.5)  # slow, but not yet for a whole interval
    shed.done(0.2, now=10.8)  # one fast completion: no standing queue
    shed.done(0.9, now=11.0)
    shed.done(0.8, now=11.9)
    assert shed.admit(inflight=3, now=11.9)
    shed.done(0.6, now=12.0)  # every completion slow for 1 s: shed
    assert not shed.admit(inflight=3, now=12.0) and not shed.admit(inflight=1, now=12.5)
    shed.done(0.9, now=12.1)
    assert not shed.admit(inflight=2, now=12.6)
    shed.done(0.4, now=12.7)  # fast again: admit
    assert shed.admit(inflight=1, now=12.7)


def test_latency_shedder_admits_once_nothing_is_in_flight_and_is_off_at_target_0():
    shed = LatencyShedder(target_s=0.5, interval_s=1.0)
    for t in (0.0, 0.5, 1.0):
        shed.done(2.0, now=t)
    assert not shed.admit(inflight=1, now=1.0)
    assert shed.admit(inflight=0, now=1.1)  # the queue drained: start over
    shed.done(2.0, now=1.2)
    assert shed.admit(inflight=1, now=1.2)  # one slow completion since, not an interval of them
    off = LatencyShedder(target_s=0.0, interval_s=1.0)
    for t in (0.0, 0.5, 1.0, 5.0):
        off.done(9.0, now=t)
    assert off.admit(inflight=50, now=5.0)


def test_while_shedding_one_retrieval_an_interval_goes_through_as_a_probe():
    """A retrieval still in flight (a large batch) keeps `inflight` above 0, and refused retrievals never complete:
    without the probe nothing would show that the queue drained until it ended."""
    shed = LatencyShedder(target_s=0.5, interval_s=1.0)
    for t in (0.0, 0.5, 1.0):
        shed.done(2.0, now=t)  # shedding from t = 1.0
    assert [shed.admit(inflight=1, now=t) for t in (1.2, 1.9, 2.0, 2.1, 2.9, 3.1)] == \
           [REFUSED, REFUSED, PROBE, REFUSED, REFUSED, PROBE]  # one an interval after the last
    shed.done(0.1, now=3.2)  # the probe was fast: the queue drained
    assert all(shed.admit(inflight=1, now=t) for t in (3.2, 3.3, 3.4))
    for t in (4.0, 4.5, 5.0):
        shed.done(2.0, now=t)  # shedding again from t = 5.0
    assert not shed.admit(inflight=1, now=5.1)
    shed.done(2.5, now=5.5)  # a slow probe keeps it shedding, and the next probe an interval after the last
    assert [shed.admit(inflight=1, now=t) for t in (5.6, 6.0, 6.1)] == [REFUSED, PROBE, REFUSED]
    shed.probe_unused()  # that probe was refused after all (or failed): the next retrieval probes at once
    assert shed.admit(inflight=1, now=6.2) is PROBE and not shed.admit(inflight=1, now=6.3)


async def asgi_call(app, method: str, path: str, headers: list | None = None) -> tuple[int, bytes]:
    """(status, body) of one request without a body, sent straight to the ASGI app (headers: (name, value) bytes)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers or [],
             "server": ("router", 80), "client": ("caller", 1)}
    status, body = 0, b""

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")

    await app(scope, receive, send)
    return status, body


def test_the_guard_sheds_only_retrievals_and_stops_once_they_are_fast_again(monkeypatch):
    """The guard over a real FastAPI app, on a clock the handlers move (no wall-clock timing). Retrievals slower than
    the target for an interval make it shed retrievals; writes and lookups still go through. While a long retrieval
    stays in flight, one retrieval an interval goes through as a probe (one refused for its headers spends none),
    and a fast one ends the shedding. Once no retrieval is in flight it starts over, whatever writes are in flight
    (a bulk write has no deadline of its own: counted, it kept every retrieval refused)."""
    clock = {"now": 1000.0}
    fake_time = SimpleNamespace(monotonic=lambda: clock["now"], time=time.time)
    monkeypatch.setattr(api, "time", fake_time)
    monkeypatch.setattr(limits, "time", fake_time)
    app = create_app(lambda cause: None)
    app.state.guard = GuardSettings(latency_target_s=0.125, latency_interval_s=0.5)
    retrieval_s, batch_done, written = {"s": 0.25}, asyncio.Event(), asyncio.Event()

    @app.post("/v1/retrieve")
    async def retrieve() -> dict:
        clock["now"] += retrieval_s["s"]
        return {}

    @app.post("/v1/retrieve:batch")
    async def retrieve_batch() -> dict:
        await batch_done.wait()
        return {}

    @app.post("/v1/ad-events")
    async def ad_events() -> dict:
        await written.wait()
        return {}

    @app.get("/v1/ads/1")
    async def lookup() -> dict:
        return {}

    async def status(method: str, path: str, headers: list | None = None) -> int:
        return (await asgi_call(app, method, path, headers))[0]

    async def slow_retrievals() -> list[int]:
        return [await status("POST", "/v1/retrieve") for _ in range(4)]  # 0.25 s each, over the 0.125 s target

    async def scenario() -> None:
        write = asyncio.create_task(status("POST", "/v1/ad-events"))
        batch = asyncio.create_task(status("POST", "/v1/retrieve:batch"))
        await asyncio.sleep(0)  # both in flight
        assert await slow_retrievals() == [200, 200, 200, 503]  # slow for an interval: shed
        retrieval_s["s"] = 0.0  # the queue drained, the batch still in flight
        refused = await asgi_call(app, "POST", "/v1/retrieve")
        assert refused[0] == 503 and json.loads(refused[1])["error"]["category"] == "overloaded"
        assert await status("GET", "/v1/ads/1") == 200  # not a retrieval: not shed
        clock["now"] += 0.5  # an interval: the next retrieval is the probe
        assert await status("POST", "/v1/retrieve", [(b"x-request-timeout-ms", b"abc")]) == 422  # spends none
        assert [await status("POST", "/v1/retrieve") for _ in range(3)] == [200, 200, 200]  # a fast probe, then all
        retrieval_s["s"] = 0.25
        assert await slow_retrievals() == [200, 200, 200, 503]  # shedding again
        batch_done.set()
        assert await batch == 200  # no retrieval in flight now; the write still is
        retrieval_s["s"] = 0.0
        assert await status("POST", "/v1/retrieve") == 200  # at once, no probe needed
        assert not write.done()
        written.set()
        assert await write == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("user, k, field", [
    ({}, 11, "k"),
    ({"history": [{"ad_id": 1, "event": "click", "ts": 1}] * 3}, 1, "user.history"),
    ({"cohorts": [1, 2, 3]}, 1, "user.cohorts"),
    ({"attributes": {"interests": ["running", "yoga", "chess"]}}, 1, "user.attributes.interests"),
    ({"attributes": {"interests": ["running", "x" * 9]}}, 1, "user.attributes.interests[1]"),
    ({"attributes": {"country": "x" * 9}}, 1, "user.attributes.country"),
    ({"co_engagement": [{"ad_id": 1, "surface": "s" * 9}]}, 1, "user.co_engagement[0].surface"),
    ({"context": {"placement": "p" * 9}}, 1, "context.placement"),
    ({"context": {"surface": "feed", "device_os": "x" * 9}}, 1, "context.device_os"),
    ({"context": {"language": ["en", "x" * 9]}}, 1, "context.language[1]"),
])
def test_each_request_limit_names_the_field_and_the_limit(user, k, field):
    limits = Limits(k=10, history=2, cohorts=2, values_per_category=2, string_chars=8)
    fields = {name: value for name, value in user.items() if name != "context"}  # the rest goes in `context`
    request = parse_request({"user": {"user_id": 1, **fields}, "context": user.get("context", {}), "k": k})
    with pytest.raises(InvalidInput) as info:
        check_requests(limits, [parse_request({"user": {"user_id": 2}, "k": 1})] * 2 + [request], "[{}].")
    assert info.value.field == f"[2].{field}" and "limits." in info.value.message
    check_requests(Limits(), [request], "")  # within the defaults


def test_a_co_engagement_surface_is_bounded_by_string_chars_alone():
    """Until 2026-12-07 the wire type refused a surface past 64 characters, under the default limit of 256, with a
    message naming no limit."""
    def request(chars: int):
        return parse_request({"user": {"user_id": 1, "co_engagement": [{"ad_id": 1, "surface": "s" * chars}]}})

    check_requests(Limits(), [request(256)], "")
    with pytest.raises(InvalidInput, match=r"limits\.string_chars") as info:
        check_requests(Limits(), [request(257)], "")
    assert info.value.field == "user.co_engagement[0].surface"


@pytest.mark.parametrize("field, error_type, value, message", [
    ("k", "less_than_equal", 10001, "at most 50 (limits.k), got 10001"),
    ("[3].user.history", "too_long", [{}] * 1025, "at most 1024 entries (limits.history), got 1025"),
    ("user.cohorts", "too_long", list(range(257)), "at most 256 entries (limits.cohorts), got 257"),
    ("user.co_engagement", "too_long", [{}] * 1025, "at most 1024 entries (limits.co_engagement), got 1025"),
    ("user.history", "list_type", "x", None),  # not past a bound
    ("context.k", "less_than_equal", 10001, None),  # no limit's field
    ("body", "too_long", [{}] * 4097, "at most 256 requests (limits.batch_requests), got 4097"),
])
def test_past_the_wire_types_bound_the_message_names_the_limit(field, error_type, value, message):
    """The wire types' bounds are the largest the limits may be set to: pydantic refuses first, named as a limit."""
    assert past_wire_bound(Limits(k=50), field, error_type, value) == message


def test_error_bodies_carry_lone_surrogates_as_escapes_and_long_echoes_cut():
    body = json.loads(error_response(422, "invalid_input", "unknown category '\ud800'", "user.attributes.\ud800").body)
    assert body["error"] == {"category": "invalid_input", "field": "user.attributes.\\ud800",
                             "message": "unknown category '\\ud800'"}
    long = json.loads(error_response(422, "invalid_input", "m", "x" * 100_000).body)["error"]["field"]
    assert long == "x" * (ECHOED_CHARS - 3) + "..." and len(long) == ECHOED_CHARS


def test_credentials_are_redacted_in_messages_and_logs(caplog):
    url = "redis://andromeda:pa55word@redis.internal:6379/0"
    assert "pa55word" not in redact(f"cannot reach {url}") and "redis.internal:6379" in redact(url)
    assert "pa55word" not in redact("rediss://:pa55word@h:6380?ssl_cert_reqs=required")
    assert "pa55word" not in redact("unix:///run/redis.sock?password=pa55word&db=0")
    install_log_redaction()
    with caplog.at_level(logging.INFO):
        logging.getLogger("andromeda.test").info("connecting to %s", url)
        try:
            raise ConnectionError(f"Error connecting to {url}")
        except ConnectionError:
            logging.getLogger("andromeda.test").exception("failed")
    assert "pa55word" not in caplog.text and "redis.internal" in caplog.text


class Body(BaseModel):
    k: int
    user: dict = {}


@pytest.fixture(scope="module")
def strict_app() -> TestClient:
    app = create_app(lambda cause: None)

    @app.post("/v1/echo")
    async def echo(body: Body) -> Body:
        return body

    return TestClient(app)


@pytest.mark.parametrize("body, message", [
    (b'{"k": 1, "k": 500}', 'the key "k" appears twice in one object'),
    (b'{"k": 1, "user": {"a": 1, "a": 2}}', 'the key "a" appears twice in one object'),
    ('{"k": 1}'.encode("utf-16"), "not UTF-8 at byte 0"),
    ('{"k": 1}'.encode("utf-32"), "not UTF-8 at byte 0"),
    (b'{"k": 1, "user": {"c": "\xff"}}', "not UTF-8 at byte 24"),
    (b'\xef\xbb\xbf{"k": 1, "user": {"c": "\xff"}}', "not UTF-8 at byte 27"),  # counted from the body's start
    (b'{"k": 1', "Expecting ',' delimiter at character 7"),
])
def test_a_body_parsers_could_read_differently_is_refused_naming_why(strict_app, body, message):
    got = strict_app.post("/v1/echo", content=body, headers={"Content-Type": "application/json"})
    assert got.status_code == 422, got.text
    assert got.json()["error"]["field"] == "body"
    assert got.json()["error"]["message"].startswith("the body is not valid JSON: ")
    assert message in got.json()["error"]["message"]


def test_the_timeout_header_is_plain_digits_sent_once(strict_app):
    """int() read "+100", " 100" and "1_000" (1000 ms); of two headers the last won, a bad first one unseen."""
    def post(headers):
        return strict_app.post("/v1/echo", content=b'{"k": 1}', headers=[("Content-Type", "application/json"), *headers])

    assert post([("X-Request-Timeout-Ms", "5000")]).status_code == 200
    for value in ("+100", " 100", "1_000", "1e3", "9" * 5000):  # 5,000 digits: int() refused them, a 500
        got = post([("X-Request-Timeout-Ms", value)])
        assert got.status_code == 422 and got.json()["error"]["field"] == "X-Request-Timeout-Ms", (value, got.text)
    twice = post([("X-Request-Timeout-Ms", "0"), ("X-Request-Timeout-Ms", "5000")])
    assert twice.status_code == 422 and "more than once" in twice.json()["error"]["message"], twice.text


def test_bodies_still_arriving_count_against_the_bound_on_requests_in_flight():
    """A body sent without Content-Length is read before the app: until 2026-12-07 a request was counted only once it
    had all arrived, so any number of them passed overload.router_inflight together."""
    app = create_app(lambda cause: None)
    app.state.guard = GuardSettings(inflight=2)
    released = asyncio.Event()

    @app.post("/v1/echo")
    async def echo(body: Body) -> Body:
        await released.wait()
        return body

    async def call(chunk_arrived: asyncio.Event, last_chunk: asyncio.Event) -> int:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/echo", "raw_path": b"/v1/echo", "root_path": "", "query_string": b"", "server": ("r", 80),
                 "client": ("caller", 1), "headers": [(b"content-type", b"application/json")]}  # no Content-Length
        chunks = [(b'{"k": ', True), (b"1}", False)]
        status = 0

        async def receive():
            body, more = chunks.pop(0)
            if not more:
                await last_chunk.wait()
            chunk_arrived.set()
            return {"type": "http.request", "body": body, "more_body": more}

        async def send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
        await app(scope, receive, send)
        return status

    async def scenario() -> list[int]:
        last_chunk = asyncio.Event()
        started = [asyncio.Event() for _ in range(4)]
        calls = [asyncio.create_task(call(e, last_chunk)) for e in started]
        for e in started[:2]:
            await e.wait()
        await asyncio.sleep(0.01)  # the other two are refused at once, their bodies still on the way
        last_chunk.set()
        await asyncio.sleep(0.01)
        released.set()
        return await asyncio.gather(*calls)
    assert sorted(asyncio.run(scenario())) == [200, 200, 503, 503]


def test_a_content_length_of_thousands_of_digits_is_too_large_not_a_500(strict_app):
    got = strict_app.post("/v1/echo", content=b'{"k": 1}', headers=[("Content-Type", "application/json"),
                                                                    ("Content-Length", "9" * 5000)])
    assert got.status_code == 413 and got.json()["error"]["field"] == "body", got.text


def test_a_body_sent_with_a_content_encoding_is_refused_whatever_its_bytes(strict_app):
    for encoding in ("gzip", "deflate", "identity, br"):
        got = strict_app.post("/v1/echo", content=b'{"k": 1}',
                              headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        assert got.status_code == 415 and got.json()["error"]["field"] == "Content-Encoding", (encoding, got.text)
    twice = strict_app.post("/v1/echo", content=b'{"k": 1}', headers=[("Content-Type", "application/json"),
                                                                     ("Content-Encoding", "identity"),
                                                                     ("Content-Encoding", "gzip")])
    assert twice.status_code == 415 and "gzip" in twice.json()["error"]["message"], twice.text
    for plain in (" IDENTITY", "identity, identity", ""):
        got = strict_app.post("/v1/echo", content=b'{"k": 1}', headers={"Content-Type": "application/json",
                                                                        "Content-Encoding": plain})
        assert got.status_code == 200 and got.json()["k"] == 1, (plain, got.text)


def test_a_utf8_body_with_or_without_a_byte_order_mark_is_read(strict_app):
    for body in (b'{"k": 7, "user": {"a": "\\u00e9"}}', b'\xef\xbb\xbf{"k": 7, "user": {"a": "\xc3\xa9"}}'):
        got = strict_app.post("/v1/echo", content=body, headers={"Content-Type": "application/json"})
        assert got.status_code == 200 and got.json()["k"] == 7, got.text


def write_attempt(store: TokenStore, buckets: TokenBuckets, token: str | None, host: str = "10.0.0.9"):
    """The write endpoints' dependency for one call -> its principal, or the AndromedaError it raised."""
    from fastapi.security import HTTPAuthorizationCredentials

    from deployments.router import writer

    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(tokens=store, buckets=buckets)),
                              client=SimpleNamespace(host=host))
    try:
        return writer(request, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) if token else None)
    except AndromedaError as exc:
        return exc


def test_refused_writes_are_held_to_the_callers_rate_and_admin_has_a_bucket_of_its_own(tmp_path):
    """A caller without a valid token, or with a reader's, was never held to a rate: it could flood the write endpoint
    with no 429. A token file's token named "admin" shared ANDROMEDA_WRITE_TOKEN's bucket (keyed by name): an
    advertiser could spend the operators' writes."""
    path = tmp_path / "tokens.json"
    named_admin, viewer = add_token(path, "admin", "advertiser", 9), add_token(path, "viewer", "reader")
    store, buckets = TokenStore("the-admin-token", str(path)), TokenBuckets(rate=0.001, burst=2, callers=16)
    assert [type(write_attempt(store, buckets, t)).__name__ for t in (None, "wrong", None)] == \
        ["Unauthorized", "Unauthorized", "RateLimited"]  # by address: 2, then 429
    assert [type(write_attempt(store, buckets, viewer)).__name__ for _ in range(3)] == \
        ["Forbidden", "Forbidden", "RateLimited"]
    assert [write_attempt(store, buckets, named_admin).advertiser_id for _ in range(2)] == [9, 9]
    assert isinstance(write_attempt(store, buckets, named_admin), RateLimited)
    assert write_attempt(store, buckets, "the-admin-token") is ENV_ADMIN  # its own bucket, still full


def test_the_admin_token_may_end_in_a_line_ending_and_token_runs_at_once_keep_every_entry(tmp_path, monkeypatch):
    """A Secret made from a file ends in a newline, which no Authorization header carries: ANDROMEDA_WRITE_TOKEN never
    matched. Two `andromeda token` runs at once each read the file before the other wrote it: one entry was lost."""
    monkeypatch.setenv("ANDROMEDA_WRITE_TOKEN", "the-admin-token\n")
    assert TokenStore(load_settings().write_token, None).verify("the-admin-token") is ENV_ADMIN  # as the router reads it
    path = tmp_path / "tokens.json"
    names = [f"adv-{i}" for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tokens = list(pool.map(lambda name: add_token(path, name, "advertiser", 7), names))
    store = TokenStore(None, str(path))
    assert all(store.verify(token).name == name for token, name in zip(tokens, names))


def test_reads_refused_for_want_of_a_token_are_held_to_the_callers_rate(tmp_path):
    """With read_auth, a caller without a valid token got 401 before its rate was taken: it could flood the reads."""
    from fastapi.security import HTTPAuthorizationCredentials

    from deployments.router import reader

    store, buckets = TokenStore("the-admin-token", None), TokenBuckets(rate=0.001, burst=2, callers=16)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(tokens=store, buckets=buckets, read_auth=True)),
                              client=SimpleNamespace(host="10.0.0.9"), headers={})
    outcomes = []
    for token in (None, "wrong", "wrong"):
        try:
            reader(request, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) if token else None)
        except AndromedaError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["Unauthorized", "Unauthorized", "RateLimited"]


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Token abc", "Bearer", "Bearer "])
def test_a_read_sending_an_authorization_that_is_no_bearer_token_is_refused(header):
    """Without read_auth, a read with a wrong bearer token got 401 but one with another scheme (or none) was served as
    if it sent nothing (until 2026-12-07)."""
    from deployments.router import reader

    state = SimpleNamespace(tokens=TokenStore("the-admin-token", None), buckets=None, read_auth=False)
    request = SimpleNamespace(app=SimpleNamespace(state=state), client=SimpleNamespace(host="10.0.0.9"),
                              headers={"authorization": header})
    with pytest.raises(AndromedaError) as refused:
        reader(request, None)  # HTTPBearer(auto_error=False) gives None for these
    assert type(refused.value).__name__ == "Unauthorized" and refused.value.field == "Authorization"
    request.headers = {}
    assert reader(request, None) is None  # no header: an anonymous read


def test_a_body_that_does_not_arrive_within_the_budget_is_refused_and_frees_its_slot():
    """Until 2026-12-07 a body that never came held its slot of overload.router_inflight while its connection stayed
    open: 32 such connections, with no token, shut out every caller."""
    app = create_app(lambda cause: None)
    app.state.guard = GuardSettings(inflight=1, request_timeout_s=0.05)

    @app.post("/v1/echo")
    async def echo(body: Body) -> Body:
        return body

    async def call(chunks: list[bytes], stall: bool) -> tuple[int, bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/echo", "raw_path": b"/v1/echo", "root_path": "", "query_string": b"", "server": ("r", 80),
                 "client": ("caller", 1), "headers": [(b"content-type", b"application/json"),
                                                      (b"content-length", b"8"), (b"x-request-timeout-ms", b"1")]}  # a
        # shorter header leaves the body its default time (writes are not bound by it)
        sent, reply = list(chunks), [0, b""]

        async def receive():
            if not sent and stall:
                await asyncio.Event().wait()  # the rest of the body never comes
            return {"type": "http.request", "body": sent.pop(0), "more_body": bool(sent) or stall}

        async def send(message):
            if message["type"] == "http.response.start":
                reply[0] = message["status"]
            elif message["type"] == "http.response.body":
                reply[1] += message.get("body", b"")
        await app(scope, receive, send)
        return reply[0], reply[1]

    async def scenario():
        slow = asyncio.create_task(call([b'{"k"'], stall=True))
        await asyncio.sleep(0.01)
        shut_out = await call([b'{"k": 1}'], stall=False)  # the slot is taken meanwhile
        started = time.monotonic()
        refused = await slow
        return shut_out, refused, time.monotonic() - started, await call([b'{"k": 1}'], stall=False)

    shut_out, (status, body), waited, after = asyncio.run(asyncio.wait_for(scenario(), 10))  # before: it hung
    assert shut_out[0] == 503 and status == 504 and waited < 1.0
    assert json.loads(body)["error"]["field"] == "body" and "did not arrive within 0.05 s" in body.decode()
    assert after[0] == 200, after


@pytest.mark.parametrize("headers, field", [
    ([("Authorization", "Bearer a"), ("Authorization", "Bearer b")], "Authorization"),
    ([("Content-Type", "text/plain")], "Content-Type"),  # with the test's own application/json: sent twice
])
def test_a_header_sent_twice_is_refused_naming_it(strict_app, headers, field):
    """Of two, Starlette read the first and a proxy in front may read the last (until 2026-12-07)."""
    got = strict_app.post("/v1/echo", content=b'{"k": 1}', headers=[("Content-Type", "application/json"), *headers])
    assert got.status_code == 422 and got.json()["error"]["field"] == field and "more than once" in got.text, got.text


@pytest.mark.parametrize("content_type, status", [
    ("application/json; charset=utf-16", 415), ("application/json; charset=ISO-8859-1", 415),
    ('application/json; charset="utf-32"', 415), ("application/json; charset=UTF-8", 200),
    ("application/json;charset=utf8", 200), ("application/problem+json", 200)])
def test_a_charset_other_than_utf8_is_refused(strict_app, content_type, status):
    """The body is read as UTF-8 whatever its charset says (until 2026-12-07 it was served), which another reader
    (a proxy, a log pipeline) honours."""
    got = strict_app.post("/v1/echo", content=b'{"k": 1}', headers={"Content-Type": content_type})
    assert got.status_code == status, got.text
    if status == 415:
        assert got.json()["error"]["field"] == "Content-Type"


def test_a_transfer_coding_other_than_chunked_is_refused_not_read_as_json(strict_app):
    got = strict_app.post("/v1/echo", content=b'{"k": 1}', headers={"Content-Type": "application/json",
                                                                    "Transfer-Encoding": "gzip, chunked"})
    assert got.status_code == 415 and got.json()["error"]["field"] == "Transfer-Encoding", got.text
    assert "gzip" in got.json()["error"]["message"]


def test_a_json_error_ending_in_at_says_at_once(strict_app):
    got = strict_app.post("/v1/echo", content=b'{"k": 1, "user": {"a": "x', headers={"Content-Type": "application/json"})
    message = got.json()["error"]["message"]
    assert got.status_code == 422 and "starting at character" in message and "at at" not in message, message
