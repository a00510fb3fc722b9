"""The plugin's options and env-var names without vLLM: choice lists imported from their owners,
bounds, and every ``VLLM_MOONEP_*`` name the repository reads known to the plugin (so the plugin
registers it with vLLM's environment validation)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_vllm_moonep_name_in_the_repository_is_registered():
    """A VLLM_MOONEP_* variable added anywhere made vLLM warn 'Unknown vLLM environment variable'."""
    from vllm_moonep.vllm_plugin.envs import KNOWN_ENV_VARS

    names = set()
    for folder in ("packages", "common", "replicated", "symmetric", "tools", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.is_file():
                names |= set(re.findall(r"VLLM_MOONEP_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")))
    names.discard("VLLM_MOONEP_WEIGHT_LAYOT")  # the deliberate typo of tests/vllm/test_plugin_options.py
    assert sorted(names - set(KNOWN_ENV_VARS)) == []


def test_options_defaults_bounds_and_choice_lists():
    """Choice lists re-declared in the plugin drift from the modules that own them; no numeric bounds."""
    from vllm_moonep.common.grouped_gemm import IMPLS
    from vllm_moonep.engine import ENGINES, TRANSPORTS
    from vllm_moonep.engine.heaps import HEAP_KINDS
    from vllm_moonep.vllm_plugin.options import CHOICES, MoonEPOptionsError, parse_options

    assert CHOICES["engine"] is ENGINES and CHOICES["transport"] is TRANSPORTS
    assert CHOICES["heap"] is HEAP_KINDS and CHOICES["impl"] is IMPLS
    o = parse_options({}, env={"VLLM_MOONEP_TRANSPORT": "Symmetric", "VLLM_MOONEP_STEP_LOG_INTERVAL": "100"})
    assert o.transport == "symmetric" and o.step_log_interval == 100
    for bad in ({"token_padding": 5000}, {"num_prefetch_slots": 0}, {"num_prefetch_slots": True},
                {"step_log_interval": 10**7}):
        with pytest.raises(MoonEPOptionsError, match=next(iter(bad))):
            parse_options({"moonep": bad}, env={})


@pytest.mark.parametrize("block,given", [
    ("symmetric", '"symmetric"'),  # valid JSON, a string where the block of options belongs
    ("[1, 2]", '"[1, 2]"'),  # a string holding JSON that is no object
    (3, "3"),
    (["symmetric"], '["symmetric"]'),
], ids=["string", "string-of-json-list", "number", "list"])
def test_a_moonep_block_that_is_no_object_is_named_as_such(block, given):
    """--additional-config '{"moonep": "symmetric"}' (valid JSON) was reported as "not valid JSON"."""
    from vllm_moonep.vllm_plugin.options import MoonEPOptionsError, parse_options

    with pytest.raises(MoonEPOptionsError) as err:
        parse_options({"moonep": block}, env={})
    msg = str(err.value)
    assert "must be a JSON object" in msg and f"got {given}" in msg and "not valid JSON" not in msg, msg
    assert '{"moonep": {"weight_layout": "symmetric"}}' in msg, msg  # what to write instead


def test_a_moonep_block_given_as_a_json_string_of_an_object_still_parses():
    """The fix for a non-object block refused a block passed as a string holding a JSON object."""
    from vllm_moonep.vllm_plugin.options import parse_options

    assert parse_options({"moonep": '{"weight_layout": "symmetric"}'}, env={}).weight_layout == "symmetric"
