"""argparse types: a bad flag value is a one-line usage error (exit 2) naming the flag, before any work;
and the one check of a checkpoint file named by an option."""
from __future__ import annotations

import argparse
import math
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from safetensors import SafetensorError

from andromeda_core.errors import InvalidInput, shown


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (no upper bound when hi is None)."""
    bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than Python converts
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {shown(text)}")
        return value

    return parse


def input_file(text: str) -> Path:
    """A file to read: it exists and is not a directory."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, not a file")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into: it exists as a directory or not at all; named (an empty name, as Path reads it, was
    the working folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: name a directory (. for this one)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
    return path


def output_file(text: str) -> Path:
    """A file to write: not a directory, in a directory that exists and may be written, or that may be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory, not a file")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    try:  # a file made and removed at once: permissions alone miss read-only mounts and /proc, even for root
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({parent} is not a writable directory)") from None
    return path


def float_above(lo: float, strict: bool) -> Callable[[str], float]:
    """A finite float >= lo (> lo when strict)."""
    bound = f"{'>' if strict else '>='} {lo:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {shown(text)}")
        return value
    return parse


non_negative_float = float_above(0, strict=False)
positive_float = float_above(0, strict=True)


def stream_name(text: str) -> str:
    """The update streams' base name, as the service takes it (andromeda_core.config.stream_problem)."""
    from andromeda_core.config import stream_problem

    if problem := stream_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


WORLD_MAX = 100_000_000  # ads or users of a synthetic world at most (its arrays hold about 100 bytes per ad)
POSITIVE = int_in(1)
NON_NEGATIVE = int_in(0)


@contextmanager
def checkpoint(option: str, path: Path | None) -> Iterator[None]:
    """Loading the checkpoint `path` given by `option`: a file that is not one is an error naming both."""
    try:
        yield
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:  # OSError: e.g. /dev/null
        if path is None:  # no checkpoint was read
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidInput(f"{path} is not a checkpoint written by `andromeda train` ({reason})", option) from None
    except InvalidInput as exc:  # a checkpoint, but not one this command takes (e.g. a ranker's to serve)
        if path is None or exc.field != "model":
            raise
        raise InvalidInput(f"{path}: {exc.message}", option) from None
