"""Serving A/B inside vLLM on two GPUs: MoonEP against vLLM's own EP backends, the same outputs,
throughput and latency, KV-cache capacity, CUDA graphs (docs/SERVING.md, "Serving A/B").

    matrix.py   5 backends x {graphs, eager}: moonep replicated / symmetric / symmetric + shared slot pool,
                allgather_reducescatter (the reference), naive (the noise floor); DP=2, EP=2
        |  per configuration (run.py): `vllm serve` on loopback (vllm_server.py), the Qwen3-30B-A3B
        v  architecture with scaled dummy weights (vllm_model_check.py)
    client.py   outputs (prompt logprobs, greedy), warm-up, a burst, two request rates (streamed)
    logs.py     the server log: KV tokens and GiB, model GiB, graphs captured, steps by runtime mode, plugin lines
        |
        v  <out>/<config>.json (one per configuration; a failed start is a row with its error)
    compare.py  distances to allgather_reducescatter per token, naive's as the noise floor
    report.py   summary.md: the tables, the symmetric KV gain against `moonep-ab project`, the targets

    python -m vllm_moonep.tools.serve_ab run --out DIR [--configs ...]   (two GPUs; tools/gpu_vllm.sh serve_ab)
    python -m vllm_moonep.tools.serve_ab summary DIR [DIR ...]          (anywhere: the rows of several calls)
"""

from vllm_moonep.tools.serve_ab.run import main

__all__ = ["main"]
