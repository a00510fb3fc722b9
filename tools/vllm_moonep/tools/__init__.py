
import vllm_moonep.engine.multicast  # noqa: F401  (first: NVLink multicast off before any library loads)
