"""Batch invariance: each row's expert output independent of the other rows of the step.

vLLM's ``VLLM_BATCH_INVARIANT=1`` asks every kernel for it, so that a sequence's tokens come out the
same whatever else is batched with it. Under MoonEP the other rows reach further than the batch:
the plan puts a token's entries on whichever rank and slot balances the step, and the segment they
land in, their place in it and the step's tokens per rank (which pick the tiles) all follow the
other tokens, on every rank.

    expert_ffn(..., batch_invariant=True)
        triton      the tiles the step runs anyway, without stream-K: a row's K sum runs in one fp32
                    accumulator, K ascending, 16 columns per MMA step, whatever the tile's rows,
                    columns or K block, its loads, swap-AB (weights on the MMA's M side) or the launch
                    count, so a row's bits do not follow the tiles the step's tokens per rank pick
                    (measured bit-equal on an H100 with Triton 3.6 at two shapes' tuned tiles and the
                    Hopper code paths: docs/PERFORMANCE.md, "Batch invariance"; another GPU generation
                    or Triton version is held to it by tests/unit/test_batch_invariance.py's GPU case,
                    not by construction); stream-K cuts a row's sum between programs and adds the
                    pieces
        reference   each segment's rows in matmuls of exactly ``ROW_BLOCK`` rows (the last block
                    filled with zero rows): a BLAS picks its kernel by the rows of the matmul
        grouped_mm, quack, deepgemm: refused, and ``auto`` takes none of them (a library's
                    kernels, its choice per problem size)
    dispatch, prefetch: byte copies (a slot row is its home row's bytes)
    combine:    each token's K rows summed in fp32, k ascending, on every transport
                (``engine/transports/base.sum_entries``, the symmetric transport's reduce kernel)

Only the expert compute has a choice to make; the engine's steps are the same either way.
"""

from __future__ import annotations

from vllm_moonep.engine.errors import MoonEPInputError

#: rows per reference matmul when batch invariant
ROW_BLOCK = 64

#: the implementations that keep a row's output independent of the step's other rows
IMPLS = ("triton", "reference")


def check_impl(impl: str, who: str) -> None:
    """``MoonEPInputError`` naming ``who`` where a batch-invariant caller asks for a library path (``auto`` and
    ``IMPLS`` pass; ``auto`` then takes one of ``IMPLS``)."""
    if impl != "auto" and impl not in IMPLS:
        raise MoonEPInputError(f"{who}: impl={impl!r} runs a library's kernels, chosen by the library per problem "
                               "size, and nothing here shows a row's output independent of the other rows there; "
                               f"batch invariance runs {IMPLS}")


#: tile options a batch-invariant step drops (``invariant_tiles``)
DROPPED = ("streamk",)


def invariant_tiles(cfg: dict) -> dict:
    """Tile config ``cfg`` (``{"gate_up": {...}, "down": {...}, ...}``) without the ``DROPPED`` options on
    either kernel."""
    return {k: ({o: v for o, v in c.items() if o not in DROPPED} if k in ("gate_up", "down") else c)
            for k, c in cfg.items()}
