"""The fused pass on the CPU: kernels/cpu_fused.cpp, compiled once per machine (g++ -O3 -march=native
-fopenmp) into a cache and called through ctypes. Same inputs and result as kernels.reference.fused."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.dispatch import require_head, require_match_inputs, require_rows, require_top

SOURCE = Path(__file__).with_name("cpu_fused.cpp")
FLAGS = ("-std=c++20", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math")  # reassociation (SIMD sums) but NaN and inf kept
STORAGE = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
TASKS_PER_THREAD = 1  # slot ranges per thread, each with its own heaps: a heap that sees more ads fills with better
# ones sooner, so more ads are skipped (1M ads, 2 threads: 1 range per thread against 8 took 6-13% less time at B = 1,
# 20-31% at B = 4 to 64)
LANES = 16  # experts per request at most (cpu_fused.cpp holds a value per expert in one register)


class BuildError(RuntimeError):
    """The CPU kernels cannot be built or loaded on this machine (no C++ compiler, flags it refuses, a cache folder
    others may write to): its setup to fix, which the message names (the CLI prints it as an error, exit 2)."""


def _machine() -> bytes:
    """What a -march=native build depends on: the architecture and the CPU's feature flags."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}".encode()


def _cache_folder() -> Path:
    """$XDG_CACHE_HOME/andromeda (default ~/.cache/andromeda), or a folder of this user's alone in the temp dir where
    that cannot be written (read-only home in a container): the library is loaded from it, so one another user could
    write to (made there first, or opened up) is refused, naming it."""
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "andromeda"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    folder = Path(tempfile.gettempdir()) / f"andromeda-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not folder.is_dir() or folder.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise BuildError(f"{folder} is not a folder of this user's alone (owner uid {info.st_uid}, mode "
                         f"{info.st_mode & 0o777:o}): the CPU kernel is loaded from it; remove it, or set XDG_CACHE_HOME "
                         "to a folder of yours")
    return folder


_BUILD = threading.Lock()  # one build at a time: the temp file is named by the process


def build(source: bytes) -> Path:
    """The shared library compiled from C++ `source` with FLAGS and then $ANDROMEDA_CXXFLAGS, in the cache folder
    (_cache_folder), built once per source, flags and machine."""
    extra = os.environ.get("ANDROMEDA_CXXFLAGS", "").split()
    flags = (*FLAGS, *extra)  # appended: e.g. -mno-avx512f
    key = hashlib.sha256(source + " ".join(flags).encode() + _machine()).hexdigest()[:16]
    path = _cache_folder() / f"cpu_fused-{key}.so"
    with _BUILD:
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            compiler = os.environ.get("CXX", "g++")
            try:
                subprocess.run([compiler, *flags, "-x", "c++", "-", "-o", str(tmp)], input=source, check=True,
                               capture_output=True)
            except (FileNotFoundError, PermissionError):
                raise BuildError(f"CXX: the CPU kernels need a C++ compiler, and {compiler!r} is none here; install g++ "
                                 "(apt-get install g++) or set CXX to one") from None
            except subprocess.CalledProcessError as exc:
                given = f" with ANDROMEDA_CXXFLAGS={' '.join(extra)!r}" if extra else ""
                raise BuildError(f"compiling {SOURCE.name} by {compiler}{given} failed:\n"
                                 f"{exc.stderr.decode(errors='replace')[-2000:].strip()}") from None
            os.replace(tmp, path)
    return path


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels (cpu_fused.cpp), built on first use (build)."""
    return ctypes.CDLL(str(build(SOURCE.read_bytes())))


def _pointer(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def packing(E: int) -> int:
    """Dims per 16-lane row of the request side (cpu_fused.cpp's P): 4 for up to 4 experts, 2 up to 8, else 1."""
    return 4 if E <= 4 else 2 if E <= 8 else 1


def packed_rows(t: torch.Tensor, P: int) -> torch.Tensor:
    """(B, E, X) -> (B, ceil(X / P), LANES): lane e * P + h of row r holds t[:, e, r * P + h] (zero past E and X)."""
    B, E, X = t.shape
    rows = -(-X // P)
    padded = torch.zeros((B, LANES // P, rows * P))
    padded[:, :E, :X] = t.float()
    return padded.reshape(B, LANES // P, rows, P).permute(0, 2, 1, 3).reshape(B, rows, LANES)


def expert_weights(experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The request side as cpu_fused.cpp reads it: experts (B, E, D), keys (B, E, G), mask (B, E) ->
    (weights (B, ceil(D / P) + ceil(G / P), LANES) float32: the experts' packed rows, then the keys';
    usable (B, LANES) uint8, lane e * P set when expert e is usable). A dot-product head (E = 1, G = 0): weights
    (B, D)."""
    B, E, _ = experts.shape
    P = packing(E)
    usable = torch.zeros((B, LANES // P, P), dtype=torch.uint8)
    usable[:, :E, 0] = mask
    if E == 1 and keys.shape[2] == 0:
        return experts[:, 0].float().contiguous(), usable.reshape(B, LANES)
    return torch.cat([packed_rows(experts, P), packed_rows(keys, P)], 1), usable.reshape(B, LANES)


def fused_scan(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
               vectors: torch.Tensor, scales: torch.Tensor | None, now: torch.Tensor, truth: torch.Tensor,
               experts: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, bias_col: int, top_n: int,
               m: int, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.reference.fused.fused_scan on CPU tensors (m and top_n at least 1), with `lib` (a build of
    cpu_fused.cpp; default: library())."""
    n, B, threads = status.shape[0], now.shape[0], torch.get_num_threads()
    require_top(m, top_n)  # an empty heap would be written through
    require_match_inputs(status, start, end, refs, truth, now)  # passed as raw pointers: dtypes and rows
    require_head(B, experts, keys, mask)
    require_rows(n, vectors, scales, experts.shape[2], keys.shape[2], bias_col)  # else read past them
    if B == 0:
        return torch.zeros((0, m), dtype=torch.int64), torch.zeros((0, m)), torch.zeros(0, dtype=torch.int64)
    if vectors.stride(1) != 1:
        vectors = vectors.contiguous()
    status, start, end, refs = (t.contiguous() for t in (status, start, end, refs))
    scales = None if scales is None else scales.float().contiguous()
    now, truth = now.contiguous(), truth.contiguous()
    if experts.shape[1] > LANES:
        raise ValueError(f"the CPU kernel takes at most {LANES} experts, got {experts.shape[1]}")
    weights, usable = expert_weights(experts, keys, mask)
    tasks = max(1, min(threads * TASKS_PER_THREAD, n))
    out_score = torch.empty((B, m), dtype=torch.float32)
    out_slot, counts = torch.empty((B, m), dtype=torch.int64), torch.empty(B, dtype=torch.int64)
    i64 = ctypes.c_int64
    failed = (library() if lib is None else lib).fused_scan(
        i64(n), i64(refs.shape[1]), i64(vectors.stride(0)), i64(0 if scales is None else scales.shape[1]),
        _pointer(status), _pointer(start), _pointer(end), _pointer(refs), _pointer(vectors),
        ctypes.c_int(STORAGE[vectors.dtype]), _pointer(scales), i64(B), i64(truth.shape[1]), i64(experts.shape[1]),
        i64(experts.shape[2]), i64(keys.shape[2]), i64(packing(experts.shape[1])), _pointer(now), _pointer(truth),
        _pointer(weights), _pointer(usable), i64(bias_col), i64(top_n), i64(m), i64(tasks), ctypes.c_int(threads), _pointer(out_score), _pointer(out_slot),
        _pointer(counts))
    if failed:
        raise MemoryError(f"the CPU kernel's heaps for {B} requests x top {m} did not fit in memory")
    return out_slot, out_score, counts


def clause_match(status: torch.Tensor, start: torch.Tensor, end: torch.Tensor, refs: torch.Tensor,
                 truth: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """kernels.reference.fused.clause_match on CPU tensors."""
    require_match_inputs(status, start, end, refs, truth, now)
    status, start, end, refs, truth, now = (t.contiguous() for t in (status, start, end, refs, truth, now))
    n, B = status.shape[0], now.shape[0]
    out = torch.empty((B, n), dtype=torch.bool)  # one byte each: the kernel writes 0 or 1
    i64 = ctypes.c_int64
    library().clause_match(i64(n), i64(refs.shape[1]), _pointer(status), _pointer(start), _pointer(end),
                           _pointer(refs), i64(B), i64(truth.shape[1]), _pointer(now), _pointer(truth),
                           ctypes.c_int(torch.get_num_threads()), _pointer(out))
    return out
