"""The offline `andromeda` command as a user runs it (a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from andromeda_core.models import distill
from andromeda_core.models.retrieval import RetrievalModel
from tests.conftest import run_in_process


def andromeda(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "andromeda_cli", *args], capture_output=True, text=True, timeout=300)
    if check and result.returncode:
        raise AssertionError(result.stderr)
    return result


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-world")
    andromeda("synth", "--ads", "2000", "--users", "5", "--seed", "1", "--out", str(out))
    return out


def test_schema_json_lists_every_category():
    schema = json.loads(andromeda("schema", "--json").stdout)
    cats = {c["name"]: c for c in schema["categories"]}
    assert len(cats) >= 20
    assert "vocabulary" in cats["country"] and cats["age"]["range"] == [13, 100]
    assert cats["custom_audiences"]["cardinality"] == 1_000_000 and cats["interests"]["multi"] is True


def test_retrieve_one_request_prints_the_response(world, tmp_path):
    request = tmp_path / "req.json"
    first = json.loads((world / "requests.jsonl").read_text().splitlines()[0])
    request.write_text(json.dumps(first, indent=2))
    out = andromeda("retrieve", "--events", str(world / "events.jsonl"), "--request", str(request), "--k", "7")
    response = json.loads(out.stdout)
    assert set(response) == {"ads", "eligible", "index_watermark", "shard_watermarks", "missing_shards", "took_ms", "warnings"}
    assert response["shard_watermarks"] == response["missing_shards"] == []  # offline: no shards, no stream
    assert len(response["ads"]) == 7 and response["eligible"] >= 7
    scores = [a["score"] for a in response["ads"]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("setting, named", [({"ANDROMEDA_CXXFLAGS": "-bogusflag"}, "ANDROMEDA_CXXFLAGS='-bogusflag'"),
                                             ({"CXX": "/nonexistent/g++"}, "CXX: ")])
def test_a_cpu_kernel_that_cannot_build_is_an_error_naming_the_setting(world, tmp_path, setting, named):
    """A compiler that is missing or refuses the flags: one error line naming the setting, not a traceback."""
    env = {**os.environ, **setting, "XDG_CACHE_HOME": str(tmp_path / "fresh")}  # no kernel built before
    out = subprocess.run([sys.executable, "-m", "andromeda_cli", "retrieve", "--events", str(world / "events.jsonl"),
                          "--request", str(world / "requests.jsonl"), "--quiet"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.startswith("error: ") and named in out.stderr, out.stderr


def test_retrieve_jsonl_gives_one_line_per_request(world):
    out = andromeda("retrieve", "--events", str(world / "events.jsonl"), "--request", str(world / "requests.jsonl"), "--quiet")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 5 and all(len(r["ads"]) == 100 for r in lines)


def test_bad_event_line_exits_2_naming_line_and_field(world, tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text((world / "events.jsonl").read_text().splitlines()[0] + '\n{"op":"delete","ad_id":1}\n')
    request = tmp_path / "req.json"
    request.write_text('{"user": {"user_id": 1}}')
    result = andromeda("retrieve", "--events", str(events), "--request", str(request), check=False)
    assert result.returncode == 2 and f"{events}:2.version" in result.stderr and result.stdout == ""


def test_train_distils_a_ranker_into_a_checkpoint_the_retriever_serves(tmp_path, capsys, monkeypatch):
    world = tmp_path / "small-world"  # few ads: their texts are embedded into this test's own cache, and by retrieve
    andromeda("synth", "--ads", "300", "--users", "5", "--seed", "1", "--out", str(world))
    sasrec, ranker, checkpoint = (tmp_path / f"{name}.safetensors" for name in ("sasrec", "ranker", "moe"))
    base = tmp_path / "cache" / "models" / "synthetic-moe-from-sasrec.safetensors"  # the default --out
    monkeypatch.setenv("ANDROMEDA_CACHE", str(tmp_path / "cache"))
    train = ("train", "--data", "synthetic", "--world", str(world), "--steps", "3")
    first = subprocess.run([sys.executable, "-m", "andromeda_cli", *train, "--model", "sasrec", "--out", str(sasrec)],
                           capture_output=True, text=True, timeout=600)  # the command as a user runs it; the rest in
    assert first.returncode == 0, first.stderr  # process (a Python and torch start each saved)
    for args in (["--model", "moe", "--init", sasrec],
                 ["--model", "ranker", "--init", base, "--out", ranker],
                 ["--model", "moe", "--init", base, "--teacher", ranker, "--distill", "0.25", "--out", checkpoint],
                 ["--model", "moe", "--init", base]):  # the same steps without a teacher
        code, _, err = run_in_process(capsys, *train, *args)
        assert code == 0, err
    config = RetrievalModel.load(checkpoint)[1]
    assert config["model"] == "moe" and config["teacher"] == "ranker.safetensors" and config["distill"] == 0.25
    assert 0 < config["teacher_users"] <= 1000
    assert config["init"] == base.name and RetrievalModel.load(base)[1]["init"] == "sasrec.safetensors"
    untaught = RetrievalModel.load(base.parent / "synthetic-moe-distill0.safetensors")[1]
    assert untaught["init"] == "synthetic-moe-from-sasrec.safetensors" and "teacher" not in untaught
    other = tmp_path / "other-world"  # enough users for ads to earn learned ids (5 users give none); few ads to embed
    andromeda("synth", "--ads", "200", "--users", "1000", "--seed", "2", "--out", str(other))
    monkeypatch.setattr(distill, "ask_teacher", lambda *_: pytest.fail("asked the teacher before refusing"))  # minutes
    for args, words in ((["--model", "sasrec", "--init", str(ranker)], "is a ranker model: a sasrec goes on only"),
                        (["--model", "moe", "--init", str(ranker)], "a moe goes on only from a moe or a sasrec"),
                        (["--model", "moe", "--init", str(base), "--out", str(base)], "would overwrite --init"),
                        (["--model", "moe", "--init", str(base), "--teacher", str(ranker), "--out", str(ranker)],
                         "would overwrite --teacher"),
                        (["--model", "moe", "--init", str(base), "--teacher", str(base), "--out", str(tmp_path / "y")],
                         "is a moe model: the teacher must be a ranker"),
                        (["--model", "moe", "--init", str(base), "--teacher", str(ranker), "--world", str(other),
                          "--out", str(tmp_path / "x")], "was trained on other data")):
        code, out, err = run_in_process(capsys, *train, *args)
        assert code == 2 and words in err and out == ""
    refused = subprocess.run([sys.executable, "-m", "andromeda_cli", "serve", "--model", str(ranker)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"})
    assert refused.returncode == 2 and "--model" in refused.stderr and "is not served" in refused.stderr  # up front,
    # not by every replica as it starts
    request = tmp_path / "req.json"
    request.write_text((world / "requests.jsonl").read_text().splitlines()[0])
    out = andromeda("retrieve", "--events", str(world / "events.jsonl"), "--request", str(request), "--k", "3",
                    "--model", str(checkpoint), "--storage", "int8", "--quiet")
    assert len(json.loads(out.stdout)["ads"]) == 3


def test_demo_runs_the_main_job_end_to_end(tmp_path):
    out = andromeda("demo", "--out", str(tmp_path / "demo"), "--ads", "1500", "--users", "4", "--show", "2")
    assert out.stdout.count("eligible ads, top 5") == 2 and "Try it yourself" in out.stdout
    assert (tmp_path / "demo" / "events.jsonl").exists()
    suggested = out.stdout.split("Try it yourself:\n")[1].strip()  # runs as printed, from another folder
    tried = subprocess.run(suggested, shell=True, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert tried.returncode == 0 and len(tried.stdout.splitlines()) == 3 and '"ads"' in tried.stdout, tried.stderr
