"""The replicated ``[E+B]`` weight layout (the proof of concept's memory model)."""

from vllm_moonep.replicated.layout import ReplicatedWeightLayout

__all__ = ["ReplicatedWeightLayout"]
