import sys

from vllm_moonep.tools.serve_ab.run import main

sys.exit(main())
