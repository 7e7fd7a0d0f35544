"""benchmarks/ab_trees.py: each tree's own package runs the command, the order rotates from
round to round, the medians and ratios come from the reports, and bad trees are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ab_trees

STUB_CLI = """
import json, os, sys
from pathlib import Path
here = Path(__file__).resolve().parents[2]
with open(os.environ["AB_LOG"], "a") as log:
    log.write(here.name + "\\n")
rates = {"1": RATE1, "8": RATE8}
print(json.dumps({"results": [
    {"concurrency": int(c), "engine_median_decode_tokens_per_s": rate}
    for c, rate in rates.items() if c in sys.argv
]}))
"""


def _stub_tree(root: Path, name: str, rate1: float, rate8: float) -> Path:
    """A tree whose `vllm_rlt.entrypoints.cli` logs its name and prints fixed figures."""
    package = root / name / "vllm_rlt"
    (package / "entrypoints").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "entrypoints" / "__init__.py").write_text("")
    cli = STUB_CLI.replace("RATE1", str(rate1)).replace("RATE8", str(rate8))
    (package / "entrypoints" / "cli.py").write_text(cli)
    return root / name


def test_each_tree_runs_in_rotated_order_and_ratios_follow(tmp_path, monkeypatch, capsys):
    base = _stub_tree(tmp_path, "base", 100.0, 400.0)
    new = _stub_tree(tmp_path, "new", 50.0, 600.0)
    log = tmp_path / "order.log"
    monkeypatch.setenv("AB_LOG", str(log))
    out = tmp_path / "ab.json"
    argv = ["--tree", f"base={base}", "--tree", f"new={new}", "--rounds", "3"]
    assert ab_trees.main([*argv, "--output", str(out), "--", "bench", "1", "8"]) == 0
    assert log.read_text().split() == ["base", "new", "new", "base", "base", "new"]
    result = json.loads(out.read_text())
    assert result["median_decode_tokens_per_s"]["new"] == {"1": 50.0, "8": 600.0}
    assert result["ratio_to_reference"]["new"] == {"1": 0.5, "8": 1.5}
    assert result["ratio_to_reference"]["base"] == {"1": 1.0, "8": 1.0}
    assert len(result["reports"]["new"]) == 3
    assert "new: c1 50 (0.500x)  c8 600 (1.500x)" in capsys.readouterr().err


def test_a_folder_without_the_package_or_one_tree_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="holds no vllm_rlt package"):
        ab_trees.main(["--tree", f"a={tmp_path}", "--tree", "b=.", "--", "bench"])
    base = _stub_tree(tmp_path, "base", 1.0, 1.0)
    with pytest.raises(SystemExit):
        ab_trees.main(["--tree", f"a={base}", "--", "bench"])
