"""The comparison with vLLM's ``fused_experts`` (``tests/gpu/test_vs_vllm_fused_experts.py``) on CPU
CI: its own logic (pairs, bf16 budgets, report) and its power to see a mis-route, with vLLM's
computation in plain torch in vLLM's place. ``tests/gpu`` skips without a GPU as a whole (its folder
is the ``gpu`` marker), so these cases run from here; with a GPU they skip (the real kernel runs)."""

from tests.gpu.test_vs_vllm_fused_experts import (  # noqa: F401  (collected here)
    test_a_misroute_fails_the_comparison_on_cpu,
    test_comparison_on_cpu_with_the_torch_stand_in,
    test_torch_stand_in_matches_the_dense_moe,
)
