"""A faster Triton interpreter for the kernel tests on CPU: the same results, less repeated work. Where Triton's
internals differ from 3.9's, the interpreter is left as it is (the tests then take longer, nothing else changes)."""
from __future__ import annotations

import inspect


def speed_up_interpreter() -> list[str]:
    """Applies what this Triton's interpreter allows of the two below; returns the names of those applied."""
    return [speed_up.__name__ for speed_up in (patch_languages_once_per_launch, xor_sums_in_numpy) if speed_up()]


def patch_languages_once_per_launch() -> bool:
    """Triton 3.9's interpreter patches triton.language for the interpreter again at every call of a jit function
    inside a kernel (inspect.getmembers over the language modules: half the time of the warm-up test). Within one
    launch nothing undoes those patches until the launch ends, so a call whose language modules this launch patched
    already would change nothing: skip it. Each launch starts afresh."""
    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set[frozenset[int]] = set()  # the language modules patched in this launch

    def patch_once(fn):
        languages = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if languages in patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = patch_lang(fn)
        patched.add(languages)
        return scope

    def launch_afresh(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    patch_once.__wrapped__ = patch_lang
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_afresh
    return True


def xor_sums_in_numpy() -> bool:
    """tl.xor_sum (which tl.sort and tl.topk call at every stage) as one numpy reduction, where the interpreter
    combines element by element in Python (its fallback for a reduction it does not know: most of the time of an
    interpreted scan with a top-k). XOR of integers: the same bits in any order. Along a given axis only: the others
    (None, negative) go the interpreter's way, whose shapes there differ from numpy's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    combine = getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is None or combine is None or not all(hasattr(reduce_ops, name) for name in ("apply_impl", "to_tensor")):
        return False
    apply_impl = reduce_ops.apply_impl

    def apply_xor_in_numpy(self, input):
        axis = getattr(self.axis, "value", self.axis)
        if self.combine_fn is not combine or len(input) != 1 or axis is None or axis < 0:  # as the interpreter does
            return apply_impl(self, input)  # (tl.sort and tl.topk reduce along a given axis >= 0)
        keep_dims = bool(getattr(self.keep_dims, "value", self.keep_dims))
        return self.to_tensor(np.bitwise_xor.reduce(input[0].handle.data, axis=axis, keepdims=keep_dims), input[0].dtype)

    reduce_ops.apply_impl = apply_xor_in_numpy
    return True
