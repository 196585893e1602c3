"""A shard replica's pass over its index for a large query: part by part, each part under a read of the index of its
own, so that updates (and other callers' passes) get in between; the parts' results as the whole's."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from andromeda_core.index import AdIndex
from andromeda_core.retriever import Retriever, UserQuery, compile_requests, concat_queries
from andromeda_core.types import parse_request
from deployments.config import ServiceConfig
from deployments.shard import ShardReplica
from tests.conftest import apply_events, upsert


def replica_over(retriever: Retriever, max_batch_size: int, marks: list[str | None]) -> object:
    """A ShardReplica (built without Ray) over `retriever`, whose consumer reports `marks` as its watermark in turn."""
    cls = ShardReplica.func_or_class
    replica = cls.__new__(cls)
    replica.config = ServiceConfig(max_batch_size=max_batch_size)
    replica.retriever = retriever
    marks_left = iter(marks)
    replica.consumer = SimpleNamespace(stats=SimpleNamespace(watermark=lambda: next(marks_left)), stop=lambda: None)
    return replica


def query_of(retriever: Retriever, ks: list[int]) -> UserQuery:
    requests = [parse_request({"user": {"user_id": i, "attributes": {"country": "US"}}, "context": {"ts": 100},
                               "k": k}) for i, k in enumerate(ks)]
    compiled = compile_requests(retriever.index.schema, requests)
    return concat_queries([UserQuery(retriever.encode([r], [c.now]), [c.values], [c.now], [r.k])
                           for r, c in zip(requests, compiled)])


def test_a_large_query_is_searched_in_parts_and_an_update_applies_between_them(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim)
    apply_events(index, scorer, [upsert(i) for i in range(1, 30)])
    retriever = Retriever(index, scorer)
    query = query_of(retriever, [3, 40, 1, 5, 7])
    whole = retriever.search(query)
    sizes, search = [], retriever.search

    def search_part(part: UserQuery):  # the first part lets an update wait for the index: it applies before the next
        sizes.append((len(part), len(index)))
        if len(sizes) == 1:
            writer = threading.Thread(target=apply_events, args=(index, scorer, [upsert(99)]))
            writer.start()
            while not index._lock._writers_waiting:
                time.sleep(0.001)
        return search(part)
    retriever.search = search_part
    result, watermark, scanned = ShardReplica.func_or_class._search(replica_over(retriever, 2, ["7-0", "5-3", "6-0"]),
                                                                    query)
    assert sizes == [(2, 29), (2, 30), (1, 30)] and watermark == "5-3" and scanned == index.high_water
    assert torch.equal(result.eligible[:2], whole.eligible[:2]) and result.eligible[2:].tolist() == [30] * 3
    assert torch.equal(result.ids[:2, :29], whole.ids[:2]) and result.ids.shape == (5, 29)  # k clamped to the table
    assert result.ids[2:4, 5:].eq(-1).all() and result.scores[2:4, 5:].eq(float("-inf")).all()  # padded past its k
    retriever.search = search
    _, watermark, _ = ShardReplica.func_or_class._search(replica_over(retriever, 2, ["7-0", None, "6-0"]), query)
    assert watermark is None  # a part read while the index missed entries: no watermark for the whole
