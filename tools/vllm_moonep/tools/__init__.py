
from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads
