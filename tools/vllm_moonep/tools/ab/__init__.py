"""``moonep-ab``: replicated versus symmetric expert layouts, memory and latency, on R ranks.

The same MoE workload (layers x tokens per rank x routing skew) runs through each configuration:

- ``replicated``: our ``ReplicatedWeightLayout`` (the PoC's memory model: ``[E+B]`` per layer);
- ``symmetric``: ``SymmetricWeightLayout`` with per-layer slots;
- ``symmetric-shared``: ``SymmetricWeightLayout`` with one ``SharedSlotPool`` for all layers;
- ``vllm-poc``: vLLM 0.33's own in-tree ``MoonEPPrepareAndFinalize``/``MoonEPExperts`` in a
  ``FusedMoEKernel``, running on our built-in engine (needs vLLM; skipped where it is absent).

Every configuration's output is checked against the dense float32 reference on a sample of
steps; a configuration that is wrong fails the run. Each configuration runs in fresh rank
processes, where its memory is measured (RSS on CPU, device memory in use on GPU) next to the
accounting, with the difference explained where it exceeds 10%.

    cli.main ── flags ──> checks.check_run        every choice, the output folder: before any work
       │
       └──> driver.run_ab
              configs.run_shape                    preset (testing.models) scaled to --budget-gb
              per configuration, fresh rank processes:
                measure.rank_build ── configs.build_ours | vllm_poc.build_poc ──> configs.Built
                memory.memory_check                measured against accounted, causes named
                measure.rank_point × tokens × maxvio ──> driver.summarize_point
                measure.rank_teardown
              plots.write_plots, OUT/moonep-ab.json
       └──> report.format_table, memory_projection.render    (printed by rank 0)

Ranks: CPU processes over gloo, or one GPU per rank over NCCL (``--device cuda``; with fewer GPUs
than ranks only ``--share-gpus`` runs, over gloo), or the processes of a torchrun launch
(``torchrun --nproc-per-node 2 -m vllm_moonep.tools.ab --device cuda``). Results: a terminal
table, a JSON file with every raw figure and the environment, and PNG plots. ``moonep-ab project``
prints per-rank expert memory of full-size models at EP 8/16/32/64 from the same accounting code
the layouts report (``vllm_moonep.tools.memory_projection``).

Public names: ``main`` (the console script), ``run_ab`` (the same run from Python, returning the
results dict), ``format_table`` (its report) and ``MAX_REF_ERR`` (the reference check's default
bound); the rest by module (``from vllm_moonep.tools.ab import measure``).
"""

from vllm_moonep.tools.ab.cli import main
from vllm_moonep.tools.ab.configs import MAX_REF_ERR
from vllm_moonep.tools.ab.driver import run_ab
from vllm_moonep.tools.ab.report import format_table

__all__ = ["MAX_REF_ERR", "format_table", "main", "run_ab"]
