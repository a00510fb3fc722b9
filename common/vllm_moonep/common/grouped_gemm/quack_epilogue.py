"""The quack-kernels pieces of ``impl="quack"``; this module imports quack (an optional
dependency), so only ``quack_impl`` imports it, lazily, and importing it is the probe of whether
quack is usable (``api.quack_unusable``).

``swiglu_route`` is a fused GEMM epilogue in quack's ``@gemm_epilogue`` contract: with gate and up
concatenated along N (``concat_layout=("B",)``) the accumulator arrives paired per output column
(``mode="acc_pair"``, gate and up of the same column), ``route_w`` is a per-row vector (varlen:
rank-1 ``[total_m]``, offset per group by the kernel), and the one output is
``silu(gate) * up * route_w`` from the float32 accumulators, rounded once to the output's dtype
(bf16): the math of ``expert_ffn_reference`` with no intermediate written. It lives at module level
so quack's compile workers can import it by name (quack fingerprints the function's source).
"""

from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import unpack
from quack.epilogue.ops import ColVecLoad
from quack.gemm_interface import gemm

__all__ = ["gemm", "swiglu_route"]


@gemm_epilogue(outputs=("act",), ops={"route_w": ColVecLoad("route_w")}, mode="acc_pair")
def swiglu_route(acc, route_w):
    gate, up = unpack(acc)
    return {"act": swiglu(gate, up) * route_w}
