"""``vllm_moonep.tools.dispatch_ab`` (engine variants' dispatch and combine against each other) and
``tools/gpu_engine_ab.sh`` (each variant's engine folder in turn, in interleaved rounds). Each case names the bug it
catches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moonep.tools import dispatch_ab

ROOT = Path(__file__).resolve().parents[2]
RUN_FIELDS = {"device": "cuda", "gpus": ["NVIDIA H200"], "backend": "nccl", "preset": "kimi-k2", "H": 7168, "E": 384,
              "K": 8, "ranks": 1, "ranks_per_node": None, "transport": "symmetric",
              "argv": ["bench_dispatch.py", "--iters", "50", "--json", "a.json"]}


def _run(tmp_path: Path, name: str, graph: dict, a2a: dict, **fields) -> str:
    """A bench_dispatch JSON with the given graph_dev_us and a2a_dev_us per token count (other columns derived)."""
    rows = [{"tokens": t, "maxvio": 0.0, "graph_dev_us": g, "dispatch_dev_us": g / 2, "combine_dev_us": None,
             "graph_us": g + 10, "dispatch_us": g, "combine_us": g, "a2a_dev_us": a2a[t], "a2a_us": a2a[t] + 5}
            for t, g in graph.items()]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**RUN_FIELDS, **fields, "rows": rows}))
    return str(path)


def test_medians_ratios_and_anchor_spread(tmp_path):
    """A ratio taken against the wrong variant (not the first named), a mean in place of the median (one slow round
    moving the figure), or an anchor's spread that hides the rounds' noise."""
    a = [_run(tmp_path, f"a{i}", {1: g, 128: 70.0}, {1: x, 128: 90.0})
         for i, (g, x) in enumerate([(30.0, 80.0), (33.0, 100.0), (90.0, 85.0)])]
    b = [_run(tmp_path, f"b{i}", {1: g, 128: 77.0}, {1: 80.0, 128: 90.0}) for i, g in enumerate([36.0, 36.0])]
    variants = dispatch_ab.load_variants([f"new:{b[0]}", f"old:{a[0]}", f"old:{a[1]}", f"new:{b[1]}", f"old:{a[2]}"])
    assert list(variants) == ["new", "old"], "the anchor is the first name given"
    table = dispatch_ab.median_table(variants)
    one = table[0]["variants"]
    assert one["old"]["graph_dev_us"] == 33.0 and one["old"]["runs"] == 3  # median, not the mean (51)
    assert one["new"]["ratio"]["graph_dev_us"] == 1.0 and one["old"]["ratio"]["graph_dev_us"] == pytest.approx(33 / 36)
    assert one["old"]["a2a_dev_us_spread"] == pytest.approx(100 / 80 - 1) and one["new"]["a2a_dev_us_spread"] == 0
    assert one["old"]["ratio"]["combine_dev_us"] is None, "a column no run timed has no ratio"
    assert table[1]["variants"]["old"]["ratio"]["graph_dev_us"] == pytest.approx(70 / 77)
    text = dispatch_ab.format_table(table, "graph_dev_us")
    assert "| 1 | 0 | 36.0 (1.000) | 33.0 (0.917) | 80.0 (0%) | 85.0 (25%) |" in text, text
    # host time beside host time: the anchor column follows the metric's kind
    assert "old a2a_us (spread)" in dispatch_ab.format_table(table, "dispatch_us")


@pytest.mark.parametrize("change,needle", [
    ({"gpus": ["NVIDIA H100 80GB HBM3"]}, "differ in gpus"),
    ({"transport": "collective"}, "differ in transport"),
    ({"ranks": 2}, "differ in ranks"),
    ({"backend": "gloo"}, "differ in backend"),
    ({"argv": ["bench_dispatch.py", "--iters", "10", "--json", "b.json"]}, "different options"),
])
def test_runs_that_cannot_be_compared_are_refused(tmp_path, change, needle):
    """Variants timed on another GPU, backend, transport or world size, or with other options (the --json path
    aside), set side by side: a ratio of two setups."""
    a = _run(tmp_path, "a", {1: 30.0}, {1: 80.0})
    b = _run(tmp_path, "b", {1: 30.0}, {1: 80.0}, **change)
    with pytest.raises(ValueError, match=needle):
        dispatch_ab.load_variants([f"a:{a}", f"b:{b}"])


def test_bad_specs_and_points_are_refused(tmp_path, capsys):
    """A run without a variant name, a single variant (nothing to compare), or runs of other points (a point one
    variant lacks) taken in."""
    a = _run(tmp_path, "a", {1: 30.0}, {1: 80.0})
    b = _run(tmp_path, "b", {1: 30.0, 128: 70.0}, {1: 80.0, 128: 90.0})
    for specs, needle in [([a, f"b:{b}"], "NAME:PATH"), ([f"a:{a}", f"a:{a}"], "two variants"),
                          ([f"a:{a}", f"b:{b}"], "different points")]:
        with pytest.raises(ValueError, match=needle):
            dispatch_ab.load_variants(specs)
    assert dispatch_ab.main([f"a:{a}", f"b:{b}"]) == 2
    assert "different points" in capsys.readouterr().err


def _tree(tmp_path: Path) -> Path:
    """A git repository holding the source roots and the script, with one commit (what `pack` archives)."""
    repo = tmp_path / "repo"
    for d in ("packages", "common", "replicated", "symmetric", "tools"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "base"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    return repo


def _sh(repo: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "tools/gpu_engine_ab.sh", *args], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_pack_refuses_bad_names_and_revisions(tmp_path):
    """A variant named 'tree' (the working tree's own name), a spec without '=', or a revision that is no commit
    packed anyway: the run would time the wrong engine under that name."""
    repo = _tree(tmp_path)
    for spec, needle in [("tree=HEAD", "not 'tree'"), ("old", "NAME=REV"), ("old=nope", "no commit 'nope'")]:
        res = _sh(repo, "pack", spec)
        assert res.returncode == 2 and needle in res.stderr, (spec, res.stderr)
    res = _sh(repo, "pack", "base=HEAD")
    assert res.returncode == 0, res.stderr
    assert (repo / ".device/engine_ab/base/packages/vllm_moonep/engine/buffer.py").is_file()


@pytest.mark.slow  # three bench_dispatch runs on two CPU ranks
def test_run_times_each_variant_and_puts_the_tree_back(tmp_path):
    """A run that times the same engine under every name (the folder not swapped), leaves another variant's
    engine in the tree afterwards, or summarizes without its anchor variant."""
    repo = _tree(tmp_path)
    assert _sh(repo, "pack", "base=HEAD").returncode == 0
    # the working tree's engine says so when imported; the packed one (the commit) does not
    init = repo / "packages/vllm_moonep/engine/__init__.py"
    init.write_text(init.read_text() + '\nimport sys as _s\nprint("ENGINE-OF-THE-TREE", file=_s.stderr)\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    roots = ":".join(str(repo / d) for d in ("packages", "common", "replicated", "symmetric", "tools"))
    out = tmp_path / "out"
    res = _sh(repo, "run", "--device", "cpu", "--ranks", "2", "--preset", "qwen3-30b-a3b", "--tokens", "2",
              "--maxvio", "0", "--iters", "2", "--warmup", "1",
              env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": roots, "MOONEP_GPU_ENV": "1",
                   "OUT": str(out), "ROUNDS": "1", "VARIANTS": "base tree"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ratio to base" in res.stdout and "| 2 | 0 |" in res.stdout, res.stdout
    assert sorted(p.name for p in out.glob("bd_*.json")) == ["bd_base_1.json", "bd_tree_1.json"]
    summary = json.loads((out / "dispatch_ab.json").read_text())
    assert summary["runs"] == {"base": 1, "tree": 1}
    assert "ENGINE-OF-THE-TREE" in (out / "bd_tree_1.log").read_text()
    assert "ENGINE-OF-THE-TREE" not in (out / "bd_base_1.log").read_text(), "the packed variant's engine did not run"
    assert "ENGINE-OF-THE-TREE" in init.read_text(), "the working tree's engine was not put back"
