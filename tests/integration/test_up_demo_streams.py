"""`andromeda up` keeps its private Redis's demo ads only while the demo model that embedded them serves."""
from __future__ import annotations

import os

from andromeda_cli.service import embedded_by_another
from deployments.config import ServiceConfig
from index_updater.publisher import Publisher
from tests.conftest import upsert
from andromeda_core.types import parse_event


def test_streams_embedded_by_another_model_are_found(redis_server, small_schema, scorer):
    server, client = redis_server
    config = ServiceConfig(redis_url=server.url if server else os.environ["REDIS_URL"], shards=2, stream="up-demo")
    assert not embedded_by_another(config, scorer.name)  # empty streams: nothing stale
    Publisher(client, small_schema, scorer, shards=2, stream="up-demo").publish([parse_event(upsert(i)) for i in (1, 2, 3)])
    assert not embedded_by_another(config, scorer.name)
    assert embedded_by_another(config, "moe-v3")
