"""``python -m vllm_moonep.tools.ab`` (and ``torchrun ... -m vllm_moonep.tools.ab``): ``moonep-ab``."""

from vllm_moonep.tools.ab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
