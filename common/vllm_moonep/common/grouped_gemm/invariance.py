"""Batch invariance: each row's expert output independent of the other rows of the step.

vLLM's ``VLLM_BATCH_INVARIANT=1`` asks every kernel for it, so that a sequence's tokens come out the
same whatever else is batched with it. Under MoonEP the other rows reach further than the batch:
the plan puts a token's entries on whichever rank and slot balances the step, and the segment they
land in, their place in it and the step's tokens per rank (which pick the tiles) all follow the
other tokens, on every rank.

    expert_ffn(..., batch_invariant=True)
        triton      one tile config for every step (the generic ``TRITON_REGIME`` tiles, three
                    launches): each row's dot products run the same K blocks in the same order
                    wherever the row sits and however many rows the step has
        reference   each segment's rows in matmuls of exactly ``ROW_BLOCK`` rows (the last block
                    filled with zero rows): a CPU BLAS picks its kernel by the rows of the matmul
        grouped_mm, quack, deepgemm: refused (a library's kernels, its choice per problem size)
    dispatch, prefetch: byte copies (a slot row is its home row's bytes)
    combine:    each token's K rows summed in fp32 over that token's rows only

Only the expert compute has a choice to make; the engine's steps are the same either way.
"""

from __future__ import annotations

#: the generic tile regime (``triton_kernels.DEFAULT_CONFIGS``) every step runs when batch invariant:
#: 64-row tiles, the middle of the three (its tile entry is the same at every shape)
TRITON_REGIME = "mid"

#: rows per reference matmul when batch invariant
ROW_BLOCK = 64

#: the implementations that keep a row's output independent of the step's other rows
IMPLS = ("triton", "reference")


def refused(impl: str) -> str:
    """Why ``batch_invariant=True`` does not run ``impl`` (one of the library paths)."""
    return (f"impl={impl!r} runs a library's kernels, chosen by the library per problem size, and nothing "
            f"here shows a row's output independent of the other rows there; batch invariance runs {IMPLS}")
