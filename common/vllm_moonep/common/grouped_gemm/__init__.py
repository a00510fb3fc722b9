"""The expert compute over MoonEP's expert-grouped shard.

For each ``cu_seqlens`` group ``g`` (rows ``[cu[g-1], cu[g])`` of ``x``) with weights
``(gate_g [I,H], up_g [I,H], down_g [H,I])``::

    y[rows] = (silu(x[rows] @ gate_g^T) * (x[rows] @ up_g^T) * route_w[rows, None]) @ down_g^T

Weights come through ``GroupedWeights``, a per-group row source: a list of pools (tensors of
rows) and, for each group, which pool and row serve it. One contiguous ``[G, out, in]`` tensor is
the simplest source; the symmetric layout's home rows, slots, peers' rows and a shared slot pool
are others, with no copies. Implementations (``impl=``):

- ``reference``: plain torch, one matmul per non-empty group (CPU or GPU; reads
  ``cu_seqlens`` on the host). The oracle.
- ``grouped_mm``: three ``torch._grouped_mm`` calls plus elementwise ops, as vLLM 0.33's
  proof of concept does (bf16 on sm90+, or on CPU where torch runs it), over a source whose
  used groups are the rows of one dense tensor.
- ``triton``: the fused Triton kernels in ``triton_kernels.py`` (any source, pointer table; tile
  bodies in ``triton_tiles.py``; at decode the tiles may run as one launch, ``triton_fused.py``).
- ``quack``: quack-kernels' varlen grouped GEMM (``quack_impl.py``; an optional extra,
  ``vllm-moonep[quack]``), bf16 on sm90+, over a dense source like ``grouped_mm``.
- ``deepgemm``: DeepGEMM's contiguous grouped bf16 GEMMs (``deepgemm_impl.py``; vLLM bundles it,
  ``vllm.third_party.deep_gemm``), sm_90/sm_100, over a dense source like ``grouped_mm``.
- ``deepgemm_down``: the Triton gate/up tiles (the activation in their epilogue), then DeepGEMM's down
  GEMM (``deepgemm_impl.py``): where each library kernel beat the other's half (``bench_levers --lever
  deepgemm_half``); needs what both need.
- ``auto``: the library kernel of a regime where it was measured faster than triton on this GPU
  (``policy.py``: per shape, a range of tokens per rank; the caller passes ``tokens``) and it runs, else
  triton on CUDA when it is importable, else grouped_mm where it applies on CUDA, else reference
  (always on CPU: torch's CPU ``_grouped_mm`` is bf16 matmuls, slower there than the reference's
  float32 ones; ``impl="grouped_mm"`` still runs it on CPU). Said once per process (per
  outcome), with the reason. An explicit ``impl`` that cannot run raises ``MoonEPInputError``
  with why (the import error, the device); its compile and launch errors propagate: no explicit
  choice falls back to another.

``batch_invariant=True`` (vLLM's ``VLLM_BATCH_INVARIANT=1``): each row's output the same bits
whatever the step's other rows (``invariance.py``): triton with its tiles minus stream-K, or the
reference in fixed-size matmuls; the library paths are refused, and ``auto`` takes none of them.

Rows past ``cu_seqlens[-1]`` are not computed: the output there is unspecified (zero in the
reference), and nothing downstream reads them. The rows of each segment's padding tail are written
as zeros unless the caller says its combine never reads them (``zero_tail=False``: the Triton kernels
then leave them as they were, ``deepgemm_down`` writes zeros there either way; the MoE step passes it for
the built-in engine).
"""

from vllm_moonep.common.grouped_gemm.api import (
    IMPLS,
    auto_regimes,
    available_impls,
    expert_ffn,
    impl_unusable,
    resolve_impl,
)
from vllm_moonep.common.grouped_gemm.reference import expert_ffn_reference
from vllm_moonep.common.grouped_gemm.weights import GroupedWeights, interleave_gate_up, interleave_w13

__all__ = [
    "IMPLS",
    "GroupedWeights",
    "auto_regimes",
    "available_impls",
    "expert_ffn",
    "expert_ffn_reference",
    "impl_unusable",
    "interleave_gate_up",
    "interleave_w13",
    "resolve_impl",
]
