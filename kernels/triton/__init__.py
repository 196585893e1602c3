"""Triton kernels reproducing kernels.reference: they run on CUDA, and on CPU only under TRITON_INTERPRET=1.

- match.py: clause match of the compact ad table for a batch of requests, with the eligible count per request.
- fused.py: the fused pass (match, mixture-of-logits score, top-m by score then slot) of reference/fused.py.
"""
