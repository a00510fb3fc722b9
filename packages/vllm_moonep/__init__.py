"""vllm-moonep: the MoonEP expert-parallel backend for vLLM.

Layers (see docs/DESIGN.md): ``engine`` (the MoonEP Buffer contract), ``common`` (pool, padding,
grouped GEMM, the layout protocol, the MoE step and the vLLM modular-kernel classes),
``replicated`` and ``symmetric`` (weight layouts), ``vllm_plugin`` (the vLLM entry point) and
``tools`` (A/B comparison, benchmarks). Only ``vllm_plugin`` and
``common.vllm_modular`` import vLLM.
"""

from vllm_moonep.multicast import disable_multicast_by_default

__version__ = "0.1.0"

# NVLink multicast (NVLS) is never used by this project; make every library we load agree
# unless the user has explicitly set the variables otherwise.
disable_multicast_by_default()
