"""Redis over TLS (`rediss://`) against a real redis-server that listens with TLS only, certificates made
for each test by the openssl CLI: `andromeda publish` appends and a shard consumer applies through the
URL alone; a client that does not trust the server's CA is refused with one line saying what to fix."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from andromeda_core.errors import AndromedaError
from andromeda_core.index import AdIndex
from andromeda_core.models.serving import load_scorer
from andromeda_cli.service import check_reachable
from deployments.config import ServiceConfig
from index_updater.consumer import ShardConsumer
from index_updater.local_redis import LocalRedis, TlsFiles, free_port
from tests.conftest import upsert
from tests.integration.conftest import eventually


def tls_missing() -> str | None:
    """Why this machine cannot run these tests, or None."""
    if shutil.which("openssl") is None or shutil.which("redis-server") is None:
        return "needs the openssl CLI and redis-server"
    # a build with TLS refuses to run without a port to listen on; one without TLS refuses the option
    done = subprocess.run(["redis-server", "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
    if "not listen anywhere" not in done.stdout + done.stderr:
        return f"redis-server was built without TLS (BUILD_TLS=yes): {(done.stdout + done.stderr).strip()[-200:]}"
    return None


def make_certs(directory: Path) -> TlsFiles:
    """A throwaway CA, and a server certificate it signed for localhost and 127.0.0.1."""
    directory.mkdir()
    ca, ca_key, cert, key, csr, ext = (directory / name for name in
                                       ("ca.pem", "ca.key", "server.pem", "server.key", "server.csr", "ext.cnf"))
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for args in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
                  "-subj", "/CN=andromeda-test-ca"],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "1",
                  "-extfile", ext]):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
    return TlsFiles(cert, key, ca)


@pytest.fixture
def tls_server(tmp_path):
    reason = tls_missing()
    if reason:
        pytest.skip(reason)
    server = LocalRedis(tmp_path / "redis", tls=make_certs(tmp_path / "pki")).start()
    yield server
    server.stop()


def publish_cli(events: Path, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "andromeda_cli", "publish", str(events), "--redis", url, "--tries", "1"],
                          capture_output=True, text=True, timeout=120)


def test_the_cli_publishes_and_a_consumer_applies_over_tls(tls_server, tmp_path, default_schema):
    url = tls_server.url
    assert url.startswith("rediss://localhost:") and "ssl_ca_certs=" in url
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(json.dumps(upsert(i)) for i in range(1, 6)) + "\n")
    done = publish_cli(events, url)
    assert done.returncode == 0 and "published 5 events" in done.stdout, done.stderr

    scorer = load_scorer(None, default_schema)  # what the CLI publishes with, without --model
    consumer = ShardConsumer(redis.Redis.from_url(url), AdIndex(default_schema, scorer.dim), scorer.name)
    consumer.catch_up()
    assert sorted(consumer.index.ad_ids()) == [1, 2, 3, 4, 5]
    check_reachable(ServiceConfig(redis_url=url, port=free_port()))  # `andromeda serve`'s start check passes
    with pytest.raises(redis.ConnectionError):  # the server takes no plaintext: the events did go over TLS
        redis.Redis.from_url(f"redis://localhost:{tls_server.port}/0", socket_timeout=5).ping()


def test_a_client_that_does_not_trust_the_ca_is_refused_with_what_to_fix(tls_server, tmp_path, default_schema):
    untrusting = f"rediss://localhost:{tls_server.port}/0?ssl_cert_reqs=required"  # the system's CAs only
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps(upsert(1)) + "\n")
    done = publish_cli(events, untrusting)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: Redis at {untrusting}") and "CERTIFICATE_VERIFY_FAILED" in line, line
    assert "ssl_ca_certs=<path>" in line

    with pytest.raises(AndromedaError, match=r"cannot reach Redis at rediss://.*ssl_ca_certs=<path>"):
        check_reachable(ServiceConfig(redis_url=untrusting, port=free_port()))

    scorer = load_scorer(None, default_schema)
    consumer = ShardConsumer(redis.Redis.from_url(untrusting), AdIndex(default_schema, scorer.dim), scorer.name,
                             block_ms=10).start()
    try:
        assert eventually(lambda: consumer.stats.errors > 0, 20)
    finally:
        consumer.stop()
    assert "CERTIFICATE_VERIFY_FAILED" in consumer.stats.last_error and "ssl_ca_certs" in consumer.health(30)[1]
