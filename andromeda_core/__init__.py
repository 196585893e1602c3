"""Andromeda core: everything a replica needs except HTTP, Ray and Redis.

- schema: targeting categories (enum / ordinal / id) and how each compiles to device columns.
- targeting: the compiler (ad rules -> column rows, user values -> per-request tensors).
- index.AdIndex: the slot-addressed structure-of-arrays ad table; versioned, atomic batches.
- snapshot: atomic, checksummed snapshots of an index.
- models: scorers (ad tower, user towers, pairwise score). retriever.Retriever: match -> score -> top-k.
- synth: the synthetic ads world with a known ground truth. cli: the `andromeda` command.
"""
