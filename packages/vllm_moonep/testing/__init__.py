"""What tests and tools share to check the product: independent references, the seeded
skewed-routing generator, the rank launcher, weight helpers, the model shapes, and vLLM's MoE
pieces outside a vLLM engine. Nothing in the product (engine, common, the layouts, the plugin)
imports this package.

Modules: ``reference`` (``dense_moe``, ``expert_ffn_float64``, ``random_expert_weights``,
``relative_error``), ``routing`` (``route``, ``maxvio``, ``sigma_for_maxvio``, ...), ``weights``
(``local_experts``, ``local_rows``), ``models`` (``MODELS``, ``ModelShape``, ``model``: the
full-size model shapes, defined once), ``launch`` (``run_on_ranks``, ``RankPool``,
``resolve_launch``, ...), ``vllm_harness`` (``vllm_moe_config``, ``ensure_workspace``,
``LayoutHolder``; imports vLLM inside its functions only). Import them by module:
``from vllm_moonep.testing.reference import dense_moe``.
"""

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads
