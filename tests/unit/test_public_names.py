"""Public names where users look for them: the vLLM modular-kernel classes from
``vllm_moonep.common``, exported lazily so that the core still imports without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.hide_vllm import HIDE_VLLM

VLLM_NAMES = ("MoonEPPrepareAndFinalize", "MoonEPExperts")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_common_does_not_import_vllm():
    """An eager re-export of the vLLM classes in common/vllm_moonep/common/__init__.py would pull vLLM into every core import."""
    code = (
        "import sys\n"
        "import vllm_moonep.common as c\n"
        "c.MoonEPMoE, c.MoonEPBufferPool, c.expert_ffn\n"
        "from vllm_moonep.common import *\n"
        "loaded = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "print('vllm modules:', loaded)\n"
        "assert not loaded, loaded\n"
        f"assert set({VLLM_NAMES!r}) <= set(dir(c)), dir(c)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stdout + out.stderr


def test_vllm_names_without_vllm_say_that_vllm_is_needed():
    """Without vLLM, asking for MoonEPExperts gave a bare AttributeError that did not say vLLM is missing."""
    code = HIDE_VLLM + (
        "try:\n"
        "    from vllm_moonep.common import MoonEPExperts\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
        "else:\n"
        "    raise SystemExit('imported without vLLM')\n"
        "import vllm_moonep.common as c\n"
        "try:\n"
        "    c.NoSuchName\n"
        "except AttributeError:\n"
        "    print('AttributeError for unknown names')\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ImportError: vllm_moonep.common.MoonEPExperts needs vLLM" in out.stdout
    assert "AttributeError for unknown names" in out.stdout


@pytest.mark.vllm
def test_vllm_classes_import_from_common():
    """The user guide's `from vllm_moonep.common import MoonEPPrepareAndFinalize, MoonEPExperts` failed."""
    from vllm_moonep.common import MoonEPExperts, MoonEPPrepareAndFinalize
    from vllm_moonep.common import vllm_modular

    assert MoonEPPrepareAndFinalize is vllm_modular.MoonEPPrepareAndFinalize
    assert MoonEPExperts is vllm_modular.MoonEPExperts


def test_product_packages_do_not_import_test_helpers():
    """The product shipped test fixtures: the dense reference and the routing generator lived in
    vllm_moonep.common, and nothing stopped a product module importing vllm_moonep.testing or the tools."""
    code = (
        "import importlib, sys\n"
        "for m in ('vllm_moonep.engine', 'vllm_moonep.common', 'vllm_moonep.replicated', 'vllm_moonep.symmetric',\n"
        "          'vllm_moonep.layouts', 'vllm_moonep.vllm_plugin.startup', 'vllm_moonep.vllm_plugin.weights',\n"
        "          'vllm_moonep.vllm_plugin.seams', 'vllm_moonep.vllm_plugin.hooks'):\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('vllm_moonep.testing', 'vllm_moonep.tools')))\n"
        "assert not bad, bad\n"
        "from importlib.machinery import PathFinder\n"
        "import vllm_moonep.common as c\n"
        "left = [n for n in ('reference', 'routing') if PathFinder.find_spec(n, list(c.__path__)) is not None]\n"
        "assert not left, f'vllm_moonep.common still ships {left}'\n"
        "print('ok')\n"
    )
    out = _run(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
