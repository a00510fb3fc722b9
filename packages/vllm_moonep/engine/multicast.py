"""NVLink multicast (NVLS) policy: off everywhere, on only by explicit opt-in.

Multicast objects can take a shared host's GPUs out of service when misused, and MoonEP's
upstream kernels rely on them. This project never calls multicast APIs; these helpers make the
libraries it drives (NCCL, PyTorch symmetric memory, NVSHMEM) agree, and let a GPU heap refuse to
start when the environment turned multicast back on without the user opting in.
"""

from __future__ import annotations

import os

#: variable -> value that keeps multicast off
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

#: set to 1 to allow a GPU heap to start with multicast enabled (we still never call it)
OPT_IN_VAR = "VLLM_MOONEP_ALLOW_MULTICAST"


def disable_multicast_by_default() -> None:
    """Set the multicast-off variables where the user has not set them."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


def multicast_enabled_vars() -> list[str]:
    """Names of the variables whose current value would let a library use multicast."""
    return [name for name, off in MULTICAST_OFF.items() if os.environ.get(name, off) != off]


def multicast_opted_in() -> bool:
    return os.environ.get(OPT_IN_VAR, "0").strip().lower() in ("1", "true", "yes")


def check_multicast_off(what: str) -> None:
    """Raise unless multicast is off, or the user explicitly opted in."""
    bad = multicast_enabled_vars()
    if bad and not multicast_opted_in():
        settings = ", ".join(f"{n}={os.environ[n]!r} (want {MULTICAST_OFF[n]!r})" for n in bad)
        raise RuntimeError(
            f"{what}: refusing to start with NVLink multicast enabled ({settings}). "
            f"vllm-moonep never uses multicast; set {OPT_IN_VAR}=1 to start anyway."
        )

