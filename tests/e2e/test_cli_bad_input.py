"""Bad or odd input to the `andromeda` command, as a new user types it: exit status 2 and one line naming the
option, setting or field (and the file and line), never a traceback, never silent acceptance. In process."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import save_file

from andromeda_cli.main import parser
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.towers import Dims
from andromeda_core.schema import DEFAULT_SCHEMA_PATH
from index_updater.local_redis import LocalRedis, free_port
from index_updater.records import shard_stream
from tests.conftest import run_in_process as andromeda, upsert

FILES = {
    "events.jsonl": "\n".join(json.dumps(upsert(i)) for i in (1, 2, 3)) + "\n",
    "bid.jsonl": json.dumps(upsert(1, bid=1e39)) + "\n",
    "planet.jsonl": json.dumps(upsert(1)) + "\n" + json.dumps(upsert(2, targeting={"planet": {"any_of": ["mars"]}})),
    "ok.json": '{"user": {"user_id": 1}}',
    "latin1.json": b'{"user": {"user_id": 1, "attributes": {"country": "\xff"}}}',
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "long_k.json": '{"user": {"user_id": 1}, "k": ' + "9" * 5000 + "}",
    "mixed.jsonl": '{"user": {"user_id": 1}}\nnot json\n',
    "list.json": "[1, 2]",
    "empty.json": "",
    "age.jsonl": '{"user": {"user_id": 1}}\n{"user": {"user_id": 2, "attributes": {"age": "27"}}}\n',
    "country.json": '{"user": {"user_id": 1, "attributes": {"country": 5}}}',
    "twice_k.json": '{"user": {"user_id": 1}, "k": 2, "k": 1}',
    "surrogate.json": '{"user": {"user_id": 1, "attributes": {"country": "\\ud800"}}}',
    "quoted.json": json.dumps(json.dumps({"user": {"user_id": 1}, "k": 3})),  # a request as a JSON string
    "hello.json": '"hello"',
    "surrogate.jsonl": json.dumps(upsert(1)).replace('"title": "', '"title": "\\udc80'),
    "twice_version.jsonl": json.dumps(upsert(1)) + '\n{"op": "pause", "ad_id": 1, "version": 8, "version": 9}\n',
    "bad.yaml": "categories: [\n",
    "binary.yaml": bytes(range(256)),
    "not_a_checkpoint.safetensors": "hello",
    "a_file": "x",
    "redis_config.yaml": "redis_url: redis://127.0.0.1:1/0\n",
    "pretty_twice.json": '{\n "user": {\n  "user_id": 1,\n  "user_id": 2\n }\n}\n',
    "broken_first.jsonl": '{"user": {"user_id": 1},, "k": 3}\n{"user": {"user_id": 2}}\n',
    "pretty_comma.json": '{\n "user": {\n  "user_id": 1,\n }\n}\n',
    "no_categories.yaml": "categories: []\n",
    "twice_shards.yaml": "shards: 2\nshards: 3\n",
    "model_missing.yaml": "model: /nonexistent/missing.safetensors\n",
    "twice_name.yaml": "categories:\n- name: a\n  kind: enum\n  name: b\n  vocabulary: [x]\n",
    "deep.yaml": "{a: " * 500 + "1" + "}" * 500 + "\n",
    "shardz.yaml": "shardz: 2\n",
    "nested_bad.yaml": "overload:\n  router_queue: 0\n",
    "snapshots_config.yaml": "snapshot_dir: /srv/andromeda/snapshots\n",
    "null_redis.yaml": "redis_url:\n",
    "tiny_rate.yaml": "rate_limit:\n  requests_per_s: 1.0e-320\n  burst: 1\n",
    "missing_tokens.yaml": "auth:\n  token_file: /nonexistent/tokens.json\n",
    "blank_stream.yaml": "stream: ' '\n",
}


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    for name, content in FILES.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def assert_refused(result: tuple[int, str, str], *words: str) -> None:
    code, out, err = result
    last = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert "error: " in last and all(w in last for w in words), err
    assert len(last) < 300, last  # caller input is echoed as a short prefix only


RETRIEVE = ("retrieve", "--quiet", "--events")
CASES = [  # (argv with {d} for the files' directory, environment, words the error line holds)
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/latin1.json"), {}, ("latin1.json:1", "not UTF-8")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/deep.json"), {}, ("deep.json:1", "nested too deeply")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/long_k.json"), {}, ("long_k.json:1", "thousands of digits")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--k", "9" * 5000), {}, ("argument --k", "999...")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--k", "10001"), {}, ("argument --k", "[1, 10000]")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/mixed.jsonl", "--k", "3"), {}, ("mixed.jsonl:2", "not JSON")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/list.json", "--k", "3"), {}, ("list.json:1", "JSON object")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/twice_k.json"), {}, ("twice_k.json:1", 'key "k" appears twice')),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/surrogate.json"), {},
     ("surrogate.json:1.user.attributes.country", "lone surrogate")),  # the field named since 2026-12-07
    (RETRIEVE + ("{d}/surrogate.jsonl", "--request", "{d}/ok.json"), {}, ("surrogate.jsonl:1.ad.creative.title", "lone")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/quoted.json"), {}, ("quoted.json:1", "JSON object, got str")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/hello.json"), {}, ("hello.json:1", "JSON object, got str")),
    (RETRIEVE + ("{d}/twice_version.jsonl", "--request", "{d}/ok.json"), {},
     ("twice_version.jsonl:2", 'key "version" appears twice')),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/empty.json"), {}, ("empty.json", "no requests")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/pretty_twice.json"), {}, ("pretty_twice.json", '"user_id" appears twice')),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/pretty_comma.json"), {}, ("pretty_comma.json", "at character 30")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/broken_first.jsonl"), {}, ("broken_first.jsonl:1", "not JSON")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/age.jsonl"), {}, ("age.jsonl:2.user.attributes.age", "integers")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/country.json"), {}, ("country.json:1.user.attributes.country",)),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--now", str(2**63)), {}, ("argument --now",)),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--now", "-5"), {}, ("argument --now", "'-5'")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}"), {}, ("argument --request", "is a directory")),
    (RETRIEVE + ("{d}", "--request", "{d}/ok.json"), {}, ("argument --events", "is a directory")),
    (RETRIEVE + ("{d}/bid.jsonl", "--request", "{d}/ok.json"), {}, ("bid.jsonl:1.ad.bid", "less than or equal")),
    (RETRIEVE + ("{d}/planet.jsonl", "--request", "{d}/ok.json"), {}, ("planet.jsonl:2.ad.targeting.planet", "(ad 2)")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--model", "{d}/missing.safetensors"), {},
     ("argument --model", "missing.safetensors: no such file")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json", "--model", "{d}/not_a_checkpoint.safetensors"), {},
     ("--model", "not_a_checkpoint.safetensors is not a checkpoint")),
    (("serve-config", "--config", "{d}/missing.yaml"), {}, ("argument --config", "missing.yaml: no such file")),
    (("serve", "--model", "{d}/not_a_checkpoint.safetensors"), {"REDIS_URL": "redis://127.0.0.1:1/0"},
     ("--model", "not_a_checkpoint.safetensors is not a checkpoint")),
    (("serve", "--model", "{d}/missing.safetensors"), {"REDIS_URL": "redis://127.0.0.1:1/0"},
     ("--model", "missing.safetensors is not a file")),
    (("serve", "--config", "{d}/model_missing.yaml"), {"REDIS_URL": "redis://127.0.0.1:1/0"},
     ("model_missing.yaml: model", "missing.safetensors is not a file")),
    (("serve-config", "--config", "{d}/shardz.yaml"), {}, ("shardz.yaml: shardz", "Extra inputs")),  # the file named
    (("serve-config", "--config", "{d}/nested_bad.yaml"), {}, ("nested_bad.yaml: overload.router_queue",)),
    (("serve-config", "--host", ""), {}, ("--host",)),
    (("train", "--data", "movielens", "--model", "moe", "--init", "{d}/not_a_checkpoint.safetensors"), {},
     ("--init", "is not a checkpoint")),
    (("train", "--data", "movielens", "--model", "moe", "--teacher", "{d}/not_a_checkpoint.safetensors"), {},
     ("--teacher", "needs --init")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json"), {"ANDROMEDA_RESCORE": "abc"}, ("ANDROMEDA_RESCORE",)),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json"), {"ANDROMEDA_DEVICE": "bogus"}, ("ANDROMEDA_DEVICE",)),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json"), {"ANDROMEDA_DEVICE": "meta"}, ("ANDROMEDA_DEVICE", "cpu or a CUDA")),
    (RETRIEVE + ("{d}/events.jsonl", "--request", "{d}/ok.json"), {"ANDROMEDA_DEVICE": "cuda:99"},
     ("ANDROMEDA_DEVICE", "CUDA device")),
    (("--schema", "{d}", "schema"), {}, ("argument --schema", "is a directory")),
    (("--schema", "{d}/bad.yaml", "schema"), {}, ("bad.yaml:2", "not YAML")),
    (("--schema", "{d}/binary.yaml", "schema"), {}, ("binary.yaml", "not UTF-8")),
    (("--schema", "{d}/ok.json", "schema"), {}, ("ok.json.categories", "list of categories")),
    (("--schema", "{d}/twice_name.yaml", "schema"), {}, ("twice_name.yaml:4", "'name' appears twice")),
    (("serve-config", "--config", "{d}/twice_shards.yaml"), {}, ("twice_shards.yaml:2", "'shards' appears twice")),
    (("schema",), {"ANDROMEDA_SCHEMA": "{d}"}, ("ANDROMEDA_SCHEMA", "Is a directory")),
    (("schema",), {"ANDROMEDA_SCHEMA": "{d}/missing.yaml"}, ("ANDROMEDA_SCHEMA", "No such file")),
    (("schema",), {"ANDROMEDA_SCHEMA": ""}, ("ANDROMEDA_SCHEMA", "must not be empty")),
    (("serve-config",), {"ANDROMEDA_STREAM": " "}, ("ANDROMEDA_STREAM", "must not be empty")),
    (("publish", "{d}/events.jsonl", "--stream", ""), {}, ("argument --stream", "must not be empty")),
    (("token", "--file", "{d}/list.json", "--name", "x", "--advertiser", "1"), {}, ("list.json", "tokens")),
    (("token", "--file", "{d}", "--name", "x", "--advertiser", "1"), {}, ("--file", "Is a directory")),
    (("token", "--file", "{d}/t.json", "--name", "x", "--advertiser", str(2**63)), {}, ("argument --advertiser",)),
    (("token", "--file", "{d}/t.json", "--name", "x", "--role", "admin", "--advertiser", "4"), {},
     ("--advertiser", "only --role advertiser", "an admin token")),
    (("token", "--file", "{d}/t.json", "--name", "bad name", "--role", "admin"), {}, ("--name", "letters")),
    (("token", "--file", "{d}/t.json", "--name", "evil\n", "--role", "admin"), {}, ("--name", "letters")),
    (("train", "--data", "synthetic", "--model", "moe", "--distill", "nan"), {}, ("argument --distill", "finite")),
    (("train", "--data", "synthetic", "--model", "moe", "--steps", "9" * 20), {}, ("argument --steps",)),
    (("train", "--data", "synthetic", "--model", "moe", "--seed", str(2**64)), {}, ("argument --seed",)),
    (("train", "--data", "movielens", "--model", "moe", "--click-weight", "4"), {}, ("--click-weight", "impressions")),
    (("train", "--data", "movielens", "--model", "moe", "--world", "{d}/w"), {}, ("--world", "ANDROMEDA_MOVIELENS")),
    (("serve-config", "--config", "{d}/deep.yaml"), {}, ("deep.yaml", "nested too deeply")),
    (("--schema", "{d}/deep.yaml", "schema"), {}, ("deep.yaml", "nested too deeply")),
    (("train", "--data", "synthetic", "--model", "moe", "--distill", "-1"), {}, ("argument --distill", ">= 0")),
    (("train", "--data", "synthetic", "--model", "moe", "--out", "{d}"), {}, ("argument --out", "is a directory")),
    (("train", "--data", "synthetic", "--model", "moe", "--out", "{d}/a_file/m.safetensors"), {},
     ("argument --out", "not a writable directory")),
    (("train", "--data", "synthetic", "--model", "moe", "--out", "/proc/m.safetensors"), {},  # writable to root by
     ("argument --out", "/proc is not a writable directory")),  # its mode bits, yet no file can be made there
    (("train", "--data", "synthetic", "--model", "moe", "--world", "{d}/a_file"), {}, ("argument --world", "not a directory")),
    (("eval", "--out", "{d}"), {}, ("argument --out", "is a directory")),
    (("publish", "{d}/events.jsonl", "--redis", "http://localhost:1"), {}, ("--redis", "redis://")),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1/0?protocol=3"), {}, ("--redis", "protocol=3")),
    (("publish", "{d}/events.jsonl"), {"REDIS_URL": "redis://localhost:1/0?decode_responses=1"},
     ("REDIS_URL", "decode_responses")),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1"), {"ANDROMEDA_SHARDS": "0"}, ("ANDROMEDA_SHARDS",)),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1"), {"ANDROMEDA_SHARDS": "1025"},
     ("ANDROMEDA_SHARDS", "1024")),  # no more shards than the service can run
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1", "--shards", "-3"), {}, ("argument --shards",)),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1", "--shards", "0"), {}, ("argument --shards",)),
    (("publish", "{d}/events.jsonl"), {"REDIS_URL": ""}, ("--redis", "REDIS_URL")),
    (("synth", "--ads", "0", "--users", "3", "--out", "{d}/w"), {}, ("argument --ads",)),
    (("--schema", "{d}/no_categories.yaml", "synth", "--ads", "5", "--users", "2", "--out", "{d}/w"), {},
     ("schema", "has no interests, behaviors")),
    (("synth", "--ads", "-5", "--users", "3", "--out", "{d}/w"), {}, ("argument --ads",)),
    (("synth", "--ads", str(10**15), "--users", "3", "--out", "{d}/w"), {}, ("argument --ads", "in [1, 100000000]")),
    (("synth", "--ads", "5", "--users", "0", "--out", "{d}/w"), {}, ("argument --users",)),
    (("synth", "--ads", "5", "--users", "3", "--seed", "-1", "--out", "{d}/w"), {}, ("argument --seed",)),
    (("synth", "--ads", "5", "--users", "3", "--out", "{d}/a_file"), {}, ("argument --out", "not a directory")),
    (("synth", "--ads", "5", "--users", "3", "--out", ""), {}, ("argument --out", "an empty path")),
    (("synth", "--ads", "5", "--users", "3", "--workers", "0", "--out", "{d}/w"), {}, ("argument --workers",)),
    (("demo", "--out", "{d}/w", "--show", "-1"), {}, ("argument --show",)),
    (("up", "--demo-ads", "0"), {}, ("argument --demo-ads", "in [1, 100000000]")),
    (("up", "--demo-ads", "-5"), {}, ("argument --demo-ads",)),
    (("serve", "--demo-ads", "-5"), {"REDIS_URL": "redis://127.0.0.1:1/0"}, ("argument --demo-ads", "in [0, 100000000]")),
    (("serve", "--port", "70000"), {"REDIS_URL": "redis://127.0.0.1:1/0"}, ("argument --port", "in [1, 65535]")),
    (("serve-config", "--shards", "0"), {}, ("argument --shards", "in [1, 1024]")),
    (("serve-config", "--redis", "redis://:pw@h:notaport/0"), {}, ("--redis", "does not parse", "'notaport'")),
    (("up", "--replicas", "257"), {}, ("argument --replicas", "in [1, 256]")),
    (("serve", "--config", "{d}/redis_config.yaml"), {"REDIS_URL": ""},  # the file's redis_url, as REDIS_URL would be
     ("cannot reach Redis at redis://127.0.0.1:1/0",)),
    (("serve",), {"REDIS_URL": ""}, ("REDIS_URL is not set, nor redis_url in --config",)),
    (("up", "--config", "{d}/redis_config.yaml"), {"REDIS_URL": ""}, ("redis_config.yaml: redis_url", "andromeda serve")),
    (("up", "--config", "{d}/snapshots_config.yaml"), {"REDIS_URL": ""},  # up's own redis-server: it empties both
     ("snapshots_config.yaml: snapshot_dir", "var/snapshots")),
    (("serve", "--config", "{d}/null_redis.yaml"), {"REDIS_URL": "redis://127.0.0.1:1/0"},
     ("null_redis.yaml: redis_url", "null is not a value")),  # not "REDIS_URL is not set"
    (("serve-config", "--config", "{d}/tiny_rate.yaml"), {}, ("tiny_rate.yaml: rate_limit.requests_per_s",)),
    (("serve-config", "--config", "{d}/redis_config.yaml"), {},  # its password would go into the Serve config
     ("redis_config.yaml: redis_url", "REDIS_URL")),
    (("serve", "--config", "{d}/missing_tokens.yaml"), {"REDIS_URL": "redis://127.0.0.1:1/0"},  # before Ray starts
     ("missing_tokens.yaml: auth.token_file", "No such file")),
    (("--schema", "{d}/ok.json", "serve"), {"REDIS_URL": "redis://127.0.0.1:1/0"}, ("ok.json.categories",)),
    (("serve",), {"REDIS_URL": "redis://127.0.0.1:1/0", "ANDROMEDA_SCHEMA": "{d}/missing.yaml"},
     ("ANDROMEDA_SCHEMA", "missing.yaml is not a file")),
    (("serve-config", "--redis", "http://x"), {}, ("--redis", "pattern")),
    (("serve-config",), {"ANDROMEDA_STREAM": "s" * 201}, ("ANDROMEDA_STREAM", "at most 200 characters")),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1"), {"ANDROMEDA_STREAM": "s" * 201},
     ("ANDROMEDA_STREAM", "at most 200 characters")),
    (("serve-config", "--config", "{d}/blank_stream.yaml"), {}, ("blank_stream.yaml: stream",)),
    (("publish", "{d}/events.jsonl", "--stream", "s" * 201), {}, ("argument --stream", "at most 200 characters")),
    (("publish", "{d}/events.jsonl", "--redis", "redis://localhost:1", "--shards", "5000"), {},
     ("argument --shards", "in [1, 1024]")),
    (("publish", "{d}/events.jsonl", "--redis", ""), {"REDIS_URL": "redis://127.0.0.1:1/0"}, ("--redis", "is empty")),
    (("demo", "--out", "{d}/w", "--ads", str(10**12)), {}, ("argument --ads", "in [1, 100000000]")),
    (("up", "--demo-ads", str(10**12)), {}, ("argument --demo-ads", "in [1, 100000000]")),
    (("train", "--data", "synthetic", "--model", "moe", "--steps", "-1"), {}, ("argument --steps",)),
    (("train", "--data", "synthetic", "--model", "moe", "--steps", "0"), {}, ("argument --steps",)),
    (("train", "--data", "synthetic", "--model", "moe", "--teacher", "{d}/not_a_checkpoint.safetensors",
      "--init", "{d}/not_a_checkpoint.safetensors"), {}, ("--teacher", "is not a checkpoint")),
    (("train", "--data", "synthetic", "--model", "moe", "--teacher", "{d}/not_a_checkpoint.safetensors",
      "--init", "{d}/not_a_checkpoint.safetensors", "--distill", "0"), {}, ("--distill", "leave out --teacher")),
]


@pytest.mark.parametrize("argv, env, words", CASES, ids=[f"{argv[0]}: {words[0]}" for argv, _, words in CASES])
def test_bad_input_exits_2_with_one_line(d, capsys, monkeypatch, argv, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(d=d))
    result = andromeda(capsys, *(a.format(d=d) for a in argv))
    assert_refused(result, *(w.format(d=d) for w in words))


def test_the_schema_flag_wins_over_the_config_files_schema(d, capsys, tmp_path):
    config = tmp_path / "schema_config.yaml"
    config.write_text(f"schema_path: {d / 'bad.yaml'}\n")
    for schema in (d / "ok.json", DEFAULT_SCHEMA_PATH):  # the shipped one named too
        code, out, err = andromeda(capsys, "--schema", schema, "serve-config", "--config", config)
        assert code == 0 and f"schema_path: {schema}" in out, err


def test_serve_refuses_a_snapshot_folder_that_is_a_file_before_ray_starts(d, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    config = tmp_path / "snapshot_file.yaml"
    config.write_text(f"snapshot_dir: {d / 'a_file'}\n")
    assert_refused(andromeda(capsys, "serve", "--config", config), "snapshot_file.yaml: snapshot_dir", "is not a folder")


def test_a_refused_token_file_leaves_no_lock_file_beside_it(d, capsys, tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    assert_refused(andromeda(capsys, "token", "--file", folder, "--name", "x", "--role", "admin"), "Is a directory")
    (tmp_path / "list.json").write_text("[1]")
    assert_refused(andromeda(capsys, "token", "--file", tmp_path / "list.json", "--name", "x", "--role", "admin"), "tokens")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.json", "tokens"]


def test_a_huge_attribute_value_is_echoed_short(d, capsys):
    request = d / "huge.json"
    request.write_text(json.dumps({"user": {"user_id": 1, "attributes": {"country": "A" * 5_000_000}}}))
    code, out, err = andromeda(capsys, *RETRIEVE, d / "events.jsonl", "--request", request)
    assert code == 0, err
    (warning,) = json.loads(out)["warnings"]
    assert warning.startswith("user.attributes.country: unknown value 'AAA") and len(warning) < 120


def test_demo_over_a_world_of_another_size_says_so(d, capsys):
    assert andromeda(capsys, "synth", "--ads", "40", "--users", "2", "--workers", "1", "--out", d / "small")[0] == 0
    assert_refused(andromeda(capsys, "demo", "--out", d / "small", "--ads", "1000"), "--ads", "40 ads and 2 users")
    code, out, err = andromeda(capsys, "demo", "--out", d / "small", "--show", "1")
    assert code == 0 and "using the demo world of 40 ads and 2 users" in out and out.count("eligible ads") == 1, err


def test_every_option_has_help_and_eval_warns_of_its_cost():
    (commands,) = parser()._subparsers._group_actions
    for name in ("synth", "retrieve", "publish", "train", "eval", "demo"):
        assert all(a.help for a in commands.choices[name]._actions), name
    (eval_help,) = [a.help for a in commands._choices_actions if a.dest == "eval"]
    assert "docs/quality.md" in eval_help and re.search(r"about (an hour|\d+ minutes) on 2 CPU cores", eval_help), eval_help


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


def test_up_on_a_taken_port_says_so_before_starting_redis(tmp_path, capsys, monkeypatch):
    """A second `up` must not start a redis-server on the running one's files (var/redis) before it fails."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert_refused(andromeda(capsys, "up", "--port", taken.getsockname()[1]), "cannot listen on 127.0.0.1")
    assert not (tmp_path / "var").exists()


def test_publish_to_a_redis_that_is_not_listening_fails_fast(d, capsys):
    url = f"redis://127.0.0.1:{free_port()}"
    assert_refused(andromeda(capsys, "publish", d / "events.jsonl", "--redis", url, "--tries", "2"),
                   url, "Connection refused", "--tries 2")


def test_publish_checks_the_whole_file_before_appending_any_of_it(d, capsys, redis_url):
    events = d / "big.jsonl"
    lines = [json.dumps(upsert(i)) for i in range(1, 2079)]
    lines[1500] = json.dumps(upsert(1501, targeting={"planet": {"any_of": ["mars"]}}))
    events.write_text("\n".join(lines) + "\n")
    assert_refused(andromeda(capsys, "publish", events, "--redis", redis_url, "--stream", "whole"), "big.jsonl:1501.ad.targeting")
    assert redis.Redis.from_url(redis_url).exists(shard_stream("whole", 0)) == 0


def test_publish_reads_a_pipe_once(tmp_path, capsys, redis_url):
    """`... | andromeda publish /dev/stdin`: the file is read once (until 2026-12-07 the check drained the pipe and
    `published 0 events` came back, exit 0)."""
    fifo, done = tmp_path / "events.fifo", threading.Event()
    os.mkfifo(fifo)

    def write() -> None:
        fifo.write_text("".join(json.dumps(upsert(i)) + "\n" for i in (1, 2, 3)))
        while not done.wait(0.05):  # a second read of the pipe gets an end of file at once, as /dev/stdin's would
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # fails while no reader has it open
            except OSError:
                pass
    writer = threading.Thread(target=write)
    writer.start()
    code, out, err = andromeda(capsys, "publish", fifo, "--redis", redis_url, "--stream", "piped")
    done.set()
    writer.join()
    assert code == 0 and "published 3 events" in out, err
    assert redis.Redis.from_url(redis_url).xlen(shard_stream("piped", 0)) == 3


def test_publish_reads_a_file_that_reports_no_size(capsys, redis_url):
    """/proc's files report a size of 0 and hold text: it is read (here: not JSON), not published as empty (exit 0)."""
    assert_refused(andromeda(capsys, "publish", "/proc/self/status", "--redis", redis_url, "--stream", "proc"),
                   "/proc/self/status:1", "not JSON")
    assert redis.Redis.from_url(redis_url).exists(shard_stream("proc", 0)) == 0


def test_publish_to_a_key_of_another_type_names_it(d, capsys, redis_url):
    redis.Redis.from_url(redis_url).set(shard_stream("taken", 0), "a string")
    assert_refused(andromeda(capsys, "publish", d / "events.jsonl", "--redis", redis_url, "--stream", "taken"),
                   "stream", "taken:0 holds a Redis string")


def test_serve_config_names_a_schema_of_the_machines_it_runs_on(capsys, monkeypatch):
    """The Serve config is for other machines: ANDROMEDA_SCHEMA may name a file that is not here."""
    monkeypatch.setenv("ANDROMEDA_SCHEMA", "/srv/andromeda/schema.yaml")
    code, out, err = andromeda(capsys, "serve-config")
    assert code == 0 and "schema_path: /srv/andromeda/schema.yaml" in out, err


def test_serve_config_warns_of_what_keeps_it_on_one_machine(d, capsys):
    """The defaults serve this machine: a loopback host and a relative snapshot folder; a cluster's config sets both."""
    code, out, err = andromeda(capsys, "serve-config")
    assert code == 0 and "warning: host 127.0.0.1" in err and "warning: snapshot_dir var/snapshots is relative" in err
    (d / "cluster.yaml").write_text("snapshot_dir: /srv/andromeda/snapshots\n")
    code, out, err = andromeda(capsys, "serve-config", "--host", "0.0.0.0", "--config", d / "cluster.yaml")
    assert code == 0 and "snapshot_dir: /srv/andromeda/snapshots" in out and "warning" not in err, err


def test_a_reader_that_goes_away_ends_the_output_quietly(capsys):
    before = signal.getsignal(signal.SIGPIPE)
    assert andromeda(capsys, "schema", "--json")[0] == 0
    assert signal.getsignal(signal.SIGPIPE) == before  # SIGPIPE's default would kill the process at any broken
    # pipe, not only stdout's: a stopped eval worker's queue, a Redis socket
    cli = subprocess.Popen([sys.executable, "-m", "andromeda_cli", "schema", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    cli.stdout.close()  # `andromeda schema --json | head -c 0`
    assert cli.wait(timeout=120) == 141 and cli.stderr.read() == b""


def test_a_checkpoint_with_a_config_that_is_not_an_object_names_the_flag(d, capsys):
    save_file({"x": torch.zeros(1)}, str(d / "list_config.safetensors"), metadata={"config": "[1, 2]"})
    for model in (d / "list_config.safetensors", "/dev/null"):
        assert_refused(andromeda(capsys, *RETRIEVE, d / "events.jsonl", "--request", d / "ok.json", "--model", model),
                       "--model")


def test_serving_a_ranker_checkpoint_names_the_flag_and_file(d, capsys):
    RetrievalModel("ranker", Dims(categories=4)).save(d / "ranker.safetensors", {"categories": ["sports"]})
    assert_refused(andromeda(capsys, *RETRIEVE, d / "events.jsonl", "--request", d / "ok.json", "--model",
                             d / "ranker.safetensors"), "--model", "ranker.safetensors", "is not served")
