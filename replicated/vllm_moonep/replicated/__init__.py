"""The replicated ``[E+B]`` weight layout (the proof of concept's memory model)."""

import vllm_moonep.engine.multicast  # noqa: F401  (first: NVLink multicast off before any library loads)

from vllm_moonep.replicated.layout import ReplicatedWeightLayout

__all__ = ["ReplicatedWeightLayout"]
