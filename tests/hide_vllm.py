"""Python source that hides vLLM from a child interpreter (a meta-path blocker): prefix it to the
code a test runs with ``python -c`` to check what works where vLLM is not installed."""

HIDE_VLLM = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'vllm' or name.startswith('vllm.'):\n"
    "            raise ImportError('vllm hidden for this test')\n"
    "sys.meta_path.insert(0, Block())\n"
)
