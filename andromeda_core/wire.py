"""How the messages between the router and the shards pickle (Ray calls): their tensors travel as numpy arrays.

torch pickles a tensor through its storage machinery, about a millisecond per tensor there and back on a 2-core
box, and a view (one request's rows of a batch's result) as its whole storage; a numpy array pickles in
microseconds and only its own elements. A request's messages carry eight small tensors (its user state, its
top-k, its history vectors)."""
from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

import numpy as np
import torch


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor on the CPU from an unpickled array; one read-only (Ray may hand arrays out of its object store
    in place) is copied, so that the tensor may be written to."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class _TensorOnWire:
    """A tensor as it pickles: its elements as a numpy array, unpickled straight into a tensor on the CPU."""

    __slots__ = ("array",)

    def __init__(self, t: torch.Tensor):
        self.array = t.detach().cpu().numpy()

    def __reduce__(self):
        return _tensor, (self.array,)


def on_wire(value: Any) -> Any:
    """A tensor as _TensorOnWire; one numpy cannot hold (bfloat16, sparse, conjugate views) and anything else as
    it is, pickled its own way."""
    if isinstance(value, torch.Tensor):
        try:
            return _TensorOnWire(value)
        except (TypeError, RuntimeError):
            return value
    return value


class NumpyPickled:
    """Base of a dataclass whose tensor fields pickle as numpy arrays; unpickled, each field is what it was (a
    tensor on the CPU; nested messages pickle their own way). copy.copy and copy.deepcopy keep their usual
    meaning (the same tensors; copies of them, on their device)."""

    def __reduce__(self):
        return type(self), tuple(on_wire(getattr(self, f.name)) for f in fields(self))

    def __copy__(self):
        return type(self)(*(getattr(self, f.name) for f in fields(self)))

    def __deepcopy__(self, memo: dict):
        return type(self)(*(copy.deepcopy(getattr(self, f.name), memo) for f in fields(self)))
