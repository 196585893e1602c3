"""Device kernels and their PyTorch references. Raw tensors in, tensors out.

- reference/match.py: targeting eligibility of an ad-table slice for a batch of requests.
- reference/topk.py: exact top-k by (score desc, ad id asc), with -1 / -inf padding.
This package imports torch (and triton) only, never the rest of the project.
"""
