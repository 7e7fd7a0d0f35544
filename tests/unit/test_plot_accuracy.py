"""benchmarks/plot_accuracy.py without matplotlib: one line naming the extra, not a traceback."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.plot_accuracy import main


def test_png_without_matplotlib_names_the_plot_extra(tmp_path, monkeypatch, capsys):
    report = tmp_path / "accuracy.json"
    row = {"setting": "depth 1", "mean_loops": 1.0, "exact_match": {"add": 0.5}}
    report.write_text(json.dumps({"model": "toy", "per_task": 2, "rows": [row]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit) as exit_info:
        main([str(report), "--png", str(tmp_path / "plot.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ".[plot]" in err and "vllm-rlt[plot]" in err
    assert not (tmp_path / "plot.png").exists()
