"""The replicated ``[E+B]`` weight layout (the proof of concept's memory model)."""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

from vllm_moonep.replicated.layout import ReplicatedWeightLayout

__all__ = ["ReplicatedWeightLayout"]
