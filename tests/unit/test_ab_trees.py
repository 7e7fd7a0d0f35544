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
log_path = Path(os.environ["AB_LOG"])
runs_before = len(log_path.read_text().split()) if log_path.exists() else 0
with open(log_path, "a") as log:
    log.write(here.name + "\\n")
if RATE1 < 0:
    sys.exit("stub failure")
gain = float(os.environ.get("AB_SECOND_GAIN", "1")) if runs_before % 2 else 1.0
rates = {"1": RATE1 * gain, "8": RATE8}
if "serve" in sys.argv:
    print(json.dumps({"output_tokens_per_s": RATE1, "offline": {"output_tokens_per_s": RATE8}}))
else:
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
    assert result["medians"]["new"] == {"1": 50.0, "8": 600.0}
    assert result["ratio_to_reference"]["new"] == {"1": 0.5, "8": 1.5}
    assert result["ratio_to_reference"]["base"] == {"1": 1.0, "8": 1.0}
    assert len(result["reports"]["new"]) == 3
    assert "new: c1 50 (0.500x)  c8 600 (1.500x)" in capsys.readouterr().err


def test_serve_reports_compare_served_and_offline(tmp_path, monkeypatch):
    base = _stub_tree(tmp_path, "base", 100.0, 120.0)
    new = _stub_tree(tmp_path, "new", 110.0, 120.0)
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.log"))
    out = tmp_path / "ab.json"
    argv = ["--tree", f"base={base}", "--tree", f"new={new}", "--rounds", "1"]
    assert ab_trees.main([*argv, "--output", str(out), "--", "bench", "serve"]) == 0
    result = json.loads(out.read_text())
    assert result["medians"]["new"] == {"served": 110.0, "offline": 120.0}
    assert result["ratio_to_reference"]["new"] == {"served": 1.1, "offline": 1.0}


def test_a_failing_run_keeps_the_runs_before_it_in_the_output(tmp_path, monkeypatch):
    base = _stub_tree(tmp_path, "base", 100.0, 400.0)
    broken = _stub_tree(tmp_path, "broken", -1.0, 0.0)
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.log"))
    out = tmp_path / "ab.json"
    argv = ["--tree", f"base={base}", "--tree", f"broken={broken}", "--output", str(out)]
    with pytest.raises(SystemExit, match="stub failure"):
        ab_trees.main([*argv, "--", "bench", "1"])
    result = json.loads(out.read_text())
    assert result["medians"] == {"base": {"1": 100.0}}
    assert result["rounds"] == {"base": 1, "broken": 0}


def test_a_folder_without_the_package_or_one_tree_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="holds no vllm_rlt package"):
        ab_trees.main(["--tree", f"a={tmp_path}", "--tree", "b=.", "--", "bench"])
    base = _stub_tree(tmp_path, "base", 1.0, 1.0)
    with pytest.raises(SystemExit):
        ab_trees.main(["--tree", f"a={base}", "--", "bench"])


def test_the_report_gives_the_gain_of_a_later_place_and_warns_when_unbalanced(
    tmp_path, monkeypatch, capsys
):
    """A stub that serves 10% more when it runs second in its round: the order effect says
    so, and an odd number of rounds with two trees is pointed out."""
    base = _stub_tree(tmp_path, "base", 100.0, 400.0)
    new = _stub_tree(tmp_path, "new", 100.0, 400.0)
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.log"))
    monkeypatch.setenv("AB_SECOND_GAIN", "1.1")
    out = tmp_path / "ab.json"
    argv = ["--tree", f"base={base}", "--tree", f"new={new}", "--output", str(out)]
    assert ab_trees.main([*argv, "--rounds", "3", "--", "bench", "1", "8"]) == 0
    result = json.loads(out.read_text())
    assert result["places"] == {"base": [0, 1, 0], "new": [1, 0, 1]}
    assert result["order_effect"]["1"] == pytest.approx(1.1)
    assert result["order_effect"]["8"] == pytest.approx(1.0)
    # base ran first twice, so its median misses the gain that new's takes
    assert result["ratio_to_reference"]["new"]["1"] == pytest.approx(1.1)
    err = capsys.readouterr().err
    assert "--rounds 3 is not a multiple of the 2 trees" in err
    assert "a later place in the round, 1: 1.100x the first" in err
    (tmp_path / "order.log").unlink()
    assert ab_trees.main([*argv, "--rounds", "4", "--", "bench", "1", "8"]) == 0
    result = json.loads(out.read_text())
    assert result["ratio_to_reference"]["new"]["1"] == pytest.approx(1.0)
    assert "not a multiple" not in capsys.readouterr().err
