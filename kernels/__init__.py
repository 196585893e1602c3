"""Device kernels and their PyTorch references. Raw tensors in, tensors out.

- reference/fused.py: the fused pass (clause match, mixture-of-logits score, top-m by score then slot):
  the definition every kernel reproduces; reference/match.py: status and time window;
  reference/topk.py: exact top-k by (score desc, ad id asc), with -1 / -inf padding (merging shards).
- triton/: the fused pass and the standalone match on CUDA; cpu.py + cpu_fused.cpp: the same on the CPU.
- dispatch.py: one entry point per op, Triton on CUDA tensors, the CPU kernel otherwise.
This package imports torch, triton and the standard library only, never the rest of the project.
"""
