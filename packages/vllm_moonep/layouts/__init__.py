"""Sets of weight layouts: one configuration (replicated, symmetric, symmetric with a shared slot
pool) over the MoE layers of a model on one rank, with the heap and slot pool it needs and a
teardown in the order the heap requires.

``LayoutSet`` is built empty and grows one layer at a time (``add_layer``), as vLLM loads
weights; ``build_layouts`` builds every layer at once. Both layouts are below this package, so
it cannot live in ``vllm_moonep.common``.
"""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

from vllm_moonep.layouts.layout_set import LAYOUT_KINDS, LayoutSet, build_layouts, layout_kind

__all__ = ["LAYOUT_KINDS", "LayoutSet", "build_layouts", "layout_kind"]
