"""The router <-> shard messages pickle their tensors as numpy arrays and come back equal."""
from __future__ import annotations

import copy
import pickle
import warnings

import torch
from ray import cloudpickle

from andromeda_core.models.towers import UserState
from andromeda_core.retriever import TopK, UserQuery, split_topk
from deployments.shard import HistoryVectors, ShardAnswer, ShardQuery


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_query_and_its_answer_come_back_equal_tensor_for_tensor():
    state = UserState(torch.randn(3, 6, 64), torch.randn(3, 6, 8).half(), torch.tensor([[True] * 6, [False] * 6, [True, False] * 3]))
    query = ShardQuery(UserQuery(state, [{"country": (1, 2)}, {}, {"age": (30,)}], [1, 2, 3], [10, 5, 1]), 12.5)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(query))
        assert back.deadline == 12.5 and back.query.values == query.query.values and back.query.k == [10, 5, 1]
        assert isinstance(back.query.users, UserState)
        for name in ("experts", "keys", "mask"):
            assert same(getattr(back.query.users, name), getattr(state, name)), name
    answer = ShardAnswer(TopK(torch.tensor([[7, -1]]), torch.tensor([[0.5, float("-inf")]]), torch.tensor([1])), "1-0", 2.0, 9)
    back = pickle.loads(cloudpickle.dumps(answer))
    assert (back.watermark, back.search_ms, back.scanned) == ("1-0", 2.0, 9)
    assert all(same(getattr(back.topk, f), getattr(answer.topk, f)) for f in ("ids", "scores", "eligible"))
    vectors = HistoryVectors(torch.randn(4, 113), torch.tensor([True, False, True, True]))
    back = pickle.loads(cloudpickle.dumps(vectors))
    assert same(back.vectors, vectors.vectors) and same(back.found, vectors.found)


def test_a_requests_rows_of_a_batch_result_travel_without_the_other_rows():
    batch = TopK(torch.arange(64 * 100).reshape(64, 100), torch.rand(64, 100), torch.arange(64))
    one = split_topk(batch, [1] * 64)[5]
    assert one.ids.untyped_storage().nbytes() == 64 * 100 * 8  # a view of the whole batch's storage
    sent = cloudpickle.dumps(one)
    assert len(sent) < 2000 < 64 * 100 * 8  # its own 100 ids and scores, not the batch's
    back = pickle.loads(sent)
    assert same(back.ids, batch.ids[5:6]) and same(back.scores, batch.scores[5:6]) and back.eligible.tolist() == [5]


def test_a_tensor_numpy_cannot_hold_and_a_plain_tensor_state_pickle_as_tensors():
    for users in (torch.randn(2, 8).bfloat16(), torch.randn(2, 8, dtype=torch.complex64).conj(),
                  torch.eye(2, 8).to_sparse()):
        query = UserQuery(users, [{}, {}], [0, 0], [1, 1])
        back = pickle.loads(cloudpickle.dumps(query)).users
        assert back.dtype == users.dtype and torch.equal(back.to_dense().resolve_conj(), users.to_dense().resolve_conj())


def test_arrays_handed_out_read_only_come_back_as_writable_tensors():
    buffers = []
    sent = pickle.dumps(HistoryVectors(torch.randn(3, 4), torch.ones(3, dtype=torch.bool)), protocol=5,
                        buffer_callback=buffers.append)  # out of band, as Ray's object store hands them back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a tensor over a read-only array
        back = pickle.loads(sent, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])
    back.vectors[0, 0] = 7.0  # would be undefined behaviour on a read-only array's memory
    assert back.vectors[0, 0] == 7.0 and back.found.all()


def test_copies_keep_their_meaning():
    shared = torch.randn(2, 6, 4, requires_grad=True)
    state = UserState(shared, shared, torch.ones(2, 6, dtype=torch.bool))
    shallow, deep = copy.copy(state), copy.deepcopy(state)
    assert shallow.experts is shared and shallow.keys is shared
    assert deep.experts is deep.keys and deep.experts is not shared and deep.experts.requires_grad
    assert torch.equal(deep.experts, shared)
