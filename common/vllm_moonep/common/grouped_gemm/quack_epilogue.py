"""The quack-kernels pieces of ``impl="quack"``; this module imports quack (an optional
dependency), so only ``quack_impl`` imports it, lazily, and importing it is the probe of whether
quack is usable (``quack_impl.quack_unusable``).

``swiglu_route`` is a fused GEMM epilogue in quack's ``@gemm_epilogue`` contract: the accumulator arrives
paired per output column (``mode="acc_pair"``, gate and up of the same column: adjacent columns of B, as an
interleaved ``w13`` has them, or B's two halves with ``concat_layout=("B",)``, which quack views in that
order), ``route_w`` is a per-row vector (varlen:
rank-1 ``[total_m]``, offset per group by the kernel), and the one output is
``silu(gate) * up * route_w`` from the float32 accumulators, rounded once to the output's dtype
(bf16): the math of ``expert_ffn_reference`` with no intermediate written. It lives at module level
so quack's compile workers can import it by name (quack fingerprints the function's source).

Its body reaches quack's helpers through their modules (``activation.swiglu``, ``epi_math.unpack``),
never as bare globals. ``@gemm_epilogue`` keys the function by its source plus a "fail-closed" key
of every global it names: a module keys by its name (its source is in quack's package fingerprint),
a function is recursed into unless it lives under ``site-packages``/``dist-packages`` (then its
name). ``swiglu`` is cutlass's ``dsl_user_op`` wrapper (code in ``cutlass/_mlir_helpers/op.py``,
``__module__`` ``quack.activation``), so it is always recursed into; with quack and cutlass
installed by ``pip --target`` into a folder not named ``site-packages`` (the device's
``/tmp/quack_site``) cutlass's own helpers are recursed into too, down to the ``ContextVar``
``_LOC_TRANSFORMS``, which has no key: the decoration raised ``TypeError`` at import (with cutlass
4.8.0 and 4.8.1 alike). Same math, same traced ops either way.
"""

from quack import activation
from quack.epilogue import math as epi_math
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import ColVecLoad
from quack.gemm_interface import gemm

__all__ = ["gemm", "swiglu_route"]


@gemm_epilogue(outputs=("act",), ops={"route_w": ColVecLoad("route_w")}, mode="acc_pair")
def swiglu_route(acc, route_w):
    gate, up = epi_math.unpack(acc)
    return {"act": activation.swiglu(gate, up) * route_w}
