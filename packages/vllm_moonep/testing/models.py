"""The full-size model shapes every tool, the memory projection and the tests measure at, defined once.

    ModelShape(name, moe_layers, E, H, I, source, K)
      -> MODELS                    the public models, in the order the tables print them
      -> model(key)                one of them by its key ("kimi-k2"; the name lowercased, spaces as "-")
      -> shape.dims()              {"H", "I", "E", "K"}: the per-layer sizes a benchmark builds

Values from the models' public ``config.json``: ``hidden_size`` (H), ``moe_intermediate_size``
(I, one expert's width), the routed experts (E: ``num_experts`` or ``n_routed_experts``),
``num_experts_per_tok`` (K) and the MoE layers (``num_hidden_layers`` less the dense ones). Routed
experts only: shared experts, attention and embeddings are not part of a shape.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelShape", "model", "model_keys"]


@dataclass(frozen=True)
class ModelShape:
    """One MoE model's routed-expert shape. ``K`` is ``None`` for a model read from sizes alone
    (the memory projection needs no top-k)."""

    name: str
    moe_layers: int
    E: int
    H: int
    I: int
    source: str = ""
    K: int | None = None

    @property
    def key(self) -> str:
        """The name tools take on their command lines (``--preset``, ``--shapes``)."""
        return self.name.lower().replace(" ", "-")

    def dims(self) -> dict[str, int]:
        """``{"H", "I", "E", "K"}`` of one layer (``ValueError`` for a shape without a top-k)."""
        if self.K is None:
            raise ValueError(f"model {self.name} has no top-k (K): it was read from sizes alone")
        return {"H": self.H, "I": self.I, "E": self.E, "K": self.K}


#: MoE layer counts from the public configs: Qwen3-30B-A3B 48 layers, all MoE; DeepSeek-V3 61
#: layers, first 3 dense; Kimi-K2 61 layers, first 1 dense. All three route top-8.
MODELS: tuple[ModelShape, ...] = (
    ModelShape("Qwen3-30B-A3B", 48, 128, 2048, 768, "config.json: num_hidden_layers 48, decoder_sparse_step 1", K=8),
    ModelShape("DeepSeek-V3", 58, 256, 7168, 2048, "61 layers, n_dense_layers/first_k_dense_replace 3", K=8),
    ModelShape("Kimi-K2", 60, 384, 7168, 2048, "61 layers, first_k_dense_replace 1", K=8),
)


def model_keys() -> list[str]:
    """The keys of ``MODELS``, in order."""
    return [m.key for m in MODELS]


def model(key: str) -> ModelShape:
    """The model of ``MODELS`` whose key is ``key`` (``KeyError`` naming the keys otherwise)."""
    for m in MODELS:
        if m.key == key:
            return m
    raise KeyError(f"unknown model {key!r}; known: {', '.join(model_keys())}")
