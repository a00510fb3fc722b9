"""Choices made for the user are said: the engine ``auto`` picks (INFO, once per process) and a
kernel policy table that cannot be read (WARNING, once, then generic tiles), a GPU that borrows another's policy (INFO, once)."""

from __future__ import annotations

import json
import logging

import pytest

import vllm_moonep.engine.defaults as defaults_mod
from vllm_moonep.common.grouped_gemm import policy
from vllm_moonep.engine import make_buffer, resolve_engine


def test_auto_engine_choice_is_said_once_at_info(monkeypatch, caplog):
    """engine='auto' falling back to the built-in engine was logged at DEBUG only, so nobody saw why."""
    monkeypatch.setattr(defaults_mod, "_SAID", set())  # a fresh process's "already said" set
    name, why = resolve_engine("auto")
    assert why, "auto must give a reason for its choice"
    with caplog.at_level(logging.INFO, logger="vllm_moonep.engine"):
        for _ in range(3):
            make_buffer(16, 128, 2, 8, 1, engine="auto", device="cpu").destroy()
    lines = [r for r in caplog.records if r.getMessage().startswith("MoonEP engine:")]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == f"MoonEP engine: {name} (engine='auto': {why})"


@pytest.fixture
def triton_kernels(monkeypatch):
    """The Triton kernels module, as if no policy table had been read yet in this process."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    monkeypatch.setattr(policy, "_TABLES", {})
    monkeypatch.setattr(defaults_mod, "_SAID", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter has its own tiles
    return tk


@pytest.mark.parametrize(
    "content,error",
    [
        ('{"devices": {', "JSONDecodeError"),
        ("[1, 2]", "ValueError"),
        ('{"entries": []}', "ValueError"),
        (None, "FileNotFoundError"),
    ],
    ids=["truncated", "not-an-object", "no-device-sections", "missing"],
)
def test_unreadable_policy_table_warns_once_and_uses_generic_tiles(triton_kernels, tmp_path, caplog, content, error):
    """A tuning.json that failed to read or parse (or kept the old per-shape form without device sections)
    silently gave every shape the generic tiles."""
    path = tmp_path / "tuning.json"
    if content is not None:
        path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        table = policy.load_table(path)
        assert policy.load_table(path) is table  # read once
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert str(path) in msg and error in msg and "generic tiles" in msg
    assert table["devices"] == {}
    pol = policy.policy_for("NVIDIA H200", (9, 0), path)
    assert pol is policy.NO_POLICY
    # a shape the packaged table tunes gets the generic regime from a broken table
    cfg = triton_kernels.select_config(2048, 768, 4000, 64, entries=list(pol.tiles))
    assert cfg in triton_kernels.DEFAULT_CONFIGS.values()


def test_policy_entries_without_their_keys_are_dropped_with_a_warning(triton_kernels, tmp_path, caplog):
    """A tile entry without 'gate_up'/'down' made select_config raise KeyError inside the first expert call; an auto
    regime without its impl did the same inside resolve_impl."""
    good = {"H": 256, "I": 256, "max_rows": 1024, "gate_up": {"BM": 16}, "down": {"BM": 32}}
    regime = {"H": 256, "I": 256, "impl": "quack", "from_tokens": 64}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"devices": {"GPU X": {"tiles": [good, {"H": 256, "I": 256, "max_rows": 4096}],
                                                      "auto": [regime, {"H": 256, "I": 256, "from_tokens": 1}]}}}))
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        pol = policy.policy_for("GPU X", (9, 0), path)
    assert list(pol.tiles) == [good] and pol.regimes == (policy.Regime("quack", 256, 256, 64),)
    assert any("1 of 2 tile entries" in r.getMessage() for r in caplog.records)
    assert any("1 of 2 auto regimes" in r.getMessage() for r in caplog.records)
    assert triton_kernels.select_config(256, 256, 4000, 8, entries=list(pol.tiles)) == {"gate_up": {"BM": 16}, "down": {"BM": 32}}


def test_packaged_policy_reads_without_warning(triton_kernels, caplog):
    """The shipped tuning.json must parse: a broken one would put every GPU on generic tiles."""
    with caplog.at_level(logging.WARNING, logger=policy.__name__):
        table = policy.load_table()
    assert table["devices"]["NVIDIA H200"]["tiles"] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for arch, name in table["fallback"].items():
        assert name in table["devices"], f"fallback {arch} names {name}, which has no section"


def test_a_gpu_without_its_own_policy_says_which_it_borrows(triton_kernels, tmp_path, caplog):
    """An H100 or a B200 silently ran the H200's tiles (the table had no device key): now a GPU of a measured
    capability borrows that section and says so once at INFO, and a GPU of another capability gets the generic
    tiles and Triton at every step size, said once too; a GPU with its own section says nothing."""
    tiles = [{"H": 256, "I": 256, "max_rows": 1024, "gate_up": {"BM": 16}, "down": {"BM": 32}}]
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fallback": {"sm_90": "GPU A"},
                                "devices": {"GPU A": {"tiles": tiles, "auto": [
                                    {"H": 256, "I": 256, "impl": "deepgemm", "from_tokens": 16, "to_tokens": 256}]}}}))
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        own = policy.policy_for("GPU A", (9, 0), path)
        for _ in range(2):
            borrowed = policy.policy_for("GPU B", (9, 0), path)
            other = policy.policy_for("GPU C", (10, 0), path)
    said = [r.getMessage() for r in caplog.records]
    assert own.section == "GPU A" and borrowed.section == "GPU A" and list(borrowed.tiles) == tiles
    assert other is policy.NO_POLICY
    assert len(said) == 2, said
    assert "GPU B" in said[0] and "GPU A" in said[0] and "sm_90" in said[0]
    assert "GPU C" in said[1] and "generic tiles" in said[1]
    assert [r.impl for r in own.regimes_at(256, 256, 16)] == ["deepgemm"]
    assert own.regimes_at(256, 256, 257) == [] and own.regimes_at(256, 256, 15) == [] and own.regimes_at(256, 256, None) == []


def test_a_gpu_measured_to_keep_another_section_says_so_not_a_guess(triton_kernels, tmp_path, caplog):
    """An H100 80GB HBM3, whose own tuning sweep and library columns kept the H200's tiles and regimes, was told
    at INFO that it ran "a guess until --tune measures this GPU": a ``same_as`` section now runs the named
    section and says the measurement instead, once. A same_as naming no section of tiles (a typo, or another
    same_as) is refused with a WARNING at load, and that GPU borrows by capability as before."""
    tiles = [{"H": 256, "I": 256, "max_rows": 1024, "gate_up": {"BM": 16}, "down": {"BM": 32}}]
    regime = {"H": 256, "I": 256, "impl": "quack", "from_tokens": 64}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fallback": {"sm_90": "GPU A"}, "devices": {
        "GPU A": {"tiles": tiles, "auto": [regime]},
        "GPU B": {"same_as": "GPU A", "measured": "kept by the sweep of day D"},
        "GPU C": {"same_as": "GPU X", "measured": "m"},
        "GPU D": {"same_as": "GPU B", "measured": "m"}}}))
    with caplog.at_level(logging.INFO):
        table = policy.load_table(path)
        for _ in range(2):
            b = policy.policy_for("GPU B", (9, 0), path)
        c = policy.policy_for("GPU C", (9, 0), path)
        d = policy.policy_for("GPU D", (9, 0), path)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert b.section == "GPU A" and list(b.tiles) == tiles and [r.impl for r in b.regimes_at(256, 256, 64)] == ["quack"]
    assert sorted(table["devices"]) == ["GPU A", "GPU B"]
    assert len(warned) == 2 and "'GPU X'" in warned[0] and "'GPU B'" in warned[1], warned
    said_b = [m for m in said if "GPU B" in m]
    assert len(said_b) == 1 and "kept by the sweep of day D" in said_b[0] and "guess" not in said_b[0], said
    # the refused aliases borrow by capability, said as the guess it is
    assert c.section == d.section == "GPU A" and any("GPU C" in m and "guess" in m for m in said), said


def test_a_same_as_gpu_with_its_own_regimes_keeps_the_tiles_and_runs_its_regimes(triton_kernels, tmp_path, caplog):
    """An H100 whose own A/B found another library split faster than the H200's regime (measured on the H100 only)
    had either to copy the H200's whole tile table or to hand the H200 a regime nothing measured there: a
    ``same_as`` section with an ``auto`` list runs the named section's tiles and its own regimes, says both once,
    and a tuning pass that gives it tiles of its own keeps those regimes."""
    from vllm_moonep.common.grouped_gemm.policy import with_tiles

    tiles = [{"H": 256, "I": 256, "max_rows": 1024, "gate_up": {"BM": 16}, "down": {"BM": 32}}]
    theirs = {"H": 256, "I": 256, "impl": "deepgemm", "from_tokens": 64}
    mine = {"H": 256, "I": 256, "impl": "deepgemm_down", "from_tokens": 64}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fallback": {"sm_90": "GPU A"}, "devices": {
        "GPU A": {"tiles": tiles, "auto": [theirs]},
        "GPU B": {"same_as": "GPU A", "measured": "kept by day D", "auto": [mine, {"impl": "quack"}]}}}))
    with caplog.at_level(logging.INFO):
        table = policy.load_table(path)
        for _ in range(2):
            b = policy.policy_for("GPU B", (9, 0), path)
        a = policy.policy_for("GPU A", (9, 0), path)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "GPU B" in r.getMessage()]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert list(b.tiles) == tiles and [r.impl for r in b.regimes_at(256, 256, 64)] == ["deepgemm_down"]
    assert [r.impl for r in a.regimes_at(256, 256, 64)] == ["deepgemm"], "the named section's regimes were changed"
    assert len(said) == 1 and "its auto regimes are its own" in said[0] and "kept by day D" in said[0], said
    assert len(warned) == 1 and "1 of 2 auto regimes" in warned[0], warned  # the regime without keys, dropped
    own = with_tiles(table, "GPU B", [{"t": "b"}], (9, 0))["devices"]["GPU B"]
    assert own == {"tiles": [{"t": "b"}], "auto": [mine]}


def test_expert_impl_choice_is_said_once_and_explicit_triton_says_why(monkeypatch, caplog):
    """impl=auto resolved silently (nobody knew which kernel ran), and impl='triton' where it cannot
    run said only 'cannot run here' without the reason (no CUDA device, or the import error). On CPU,
    auto took torch's CPU _grouped_mm wherever the weights were one dense tensor: bf16 matmuls, 5-8x
    slower than the reference's float32 ones on the CI machine, so the CPU A/B timed the replicated
    and symmetric layouts with another kernel than symmetric-shared (whose slot pool is not dense)."""
    import torch

    from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn
    from vllm_moonep.engine import MoonEPInputError

    monkeypatch.setattr(defaults_mod, "_SAID", set())
    g = torch.Generator().manual_seed(0)
    w = GroupedWeights.contiguous(*(torch.randn(2, 8, 8, generator=g).to(torch.bfloat16) for _ in range(3)))
    x = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    rw = torch.ones(4)
    cu = torch.tensor([2, 4], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="vllm_moonep.common"):
        for _ in range(3):
            expert_ffn(x, rw, cu, w, impl="auto")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MoonEP expert compute:")]
    assert len(said) == 1, said
    assert "impl=auto ->" in said[0] and "the Triton kernels need a CUDA device" in said[0], said[0]
    assert "impl=auto -> reference on cpu" in said[0] and "float32" in said[0], said[0]  # dense weights, still reference
    with pytest.raises(MoonEPInputError, match="impl='triton' cannot run here: the Triton kernels need a CUDA device"):
        expert_ffn(x, rw, cu, w, impl="triton")


@pytest.mark.parametrize("ws, skip, where", [(True, False, "warp-specialized"), (False, True, "padding")])
def test_flat_tiles_that_cannot_flatten_are_said(triton_kernels, monkeypatch, caplog, ws, skip, where):
    """A tile config's "flat" dropped without a word where Triton cannot flatten the loop (with the
    warp-specialized loop, or on padded steps, whose tile skip varies the loop bound)."""
    monkeypatch.setattr(defaults_mod, "_SAID", set())
    with caplog.at_level(logging.INFO, logger=triton_kernels.__name__):
        for _ in range(3):
            assert triton_kernels._flat({"flat": True}, ws, skip) is False
        assert triton_kernels._flat({"flat": True}, False, False) is True
        assert triton_kernels._flat({}, False, False) is False
    lines = [r.getMessage() for r in caplog.records if '"flat"' in r.getMessage()]
    assert len(lines) == 1 and where in lines[0], lines


def test_symmetric_layout_says_its_w13_order_once(monkeypatch, caplog):
    """The symmetric layout storing w13 interleaved (and so the adopted parameters' rows) without saying so: a
    reader of vLLM's w13_weight after loading would find gate and up in another order than vLLM wrote them."""
    from vllm_moonep.symmetric import SymmetricWeightLayout
    from vllm_moonep.testing.reference import random_expert_weights

    monkeypatch.setattr(defaults_mod, "_SAID", set())
    w13, w2 = random_expert_weights(2, 128, 128, seed=1)
    with caplog.at_level(logging.INFO, logger="vllm_moonep.symmetric"):
        for _ in range(2):
            SymmetricWeightLayout(w13.clone(), w2.clone(), 2, 1, heap="host").destroy()
    said = [r for r in caplog.records if "interleaved" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in said]
    assert "adopted parameters hold that order" in said[0].getMessage()
