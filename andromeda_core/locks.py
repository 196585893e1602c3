"""The index's read/write lock: scans share it, a batch of updates holds it alone for the moment it writes."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class ReadWriteLock:
    """Any number of readers or one writer. Writer-preferring: once a writer waits, arriving readers wait
    behind it, so back-to-back scans cannot starve updates. A thread that already reads may read again
    (a nested read would otherwise deadlock behind a waiting writer); a reader may not start writing."""

    def __init__(self) -> None:
        self._writer = threading.Lock()  # writers one at a time: see writing()
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._depth = threading.local()  # this thread's nested reads

    @contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if not depth:
            with self._cond:
                self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
                self._readers += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if not depth:
                with self._cond:
                    self._readers -= 1
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """The writers' turn, one at a time, while readers go on: a writer works its batch out here against a table
        that only writers change, then takes `exclusive` (inside this) for the moment it writes."""
        self._refuse_if_reading()
        with self._writer:
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The table alone, for the moment a writer writes: taken inside `writing()`."""
        self._refuse_if_reading()
        if not self._writer.locked():
            raise RuntimeError("exclusive() is taken inside writing(): writers work their batch out in their turn")
        with self._cond:
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._writing and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _refuse_if_reading(self) -> None:
        if getattr(self._depth, "n", 0):
            raise RuntimeError("cannot write while this thread holds a read (it would wait for itself)")
