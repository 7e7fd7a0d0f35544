"""benchmarks/ab_constants.py: one bench-throughput report per setting, each run with its
constants in place, and bad settings named."""

from __future__ import annotations

import json

import pytest

from benchmarks import ab_constants
from vllm_rlt.bench import throughput

BENCH = ["--shape", "toy", "--device", "cpu", "--no-baseline", "--concurrency", "1"]
BENCH += ["--prompt-len", "4", "--output-len", "2", "--repeats", "1"]


def test_every_setting_runs_with_its_constant_in_place(tmp_path, monkeypatch, capsys):
    seen = []
    real_main = throughput.main

    def spy(argv):
        seen.append(throughput.MAX_WAVES)
        return real_main(argv)

    monkeypatch.setattr(throughput, "main", spy)
    monkeypatch.setattr(throughput, "MAX_WAVES", throughput.MAX_WAVES)  # restored afterwards
    out = tmp_path / "ab.json"
    setting = "vllm_rlt.bench.throughput.MAX_WAVES=7,9"
    assert ab_constants.main(["--output", str(out), "--set", setting, "--", *BENCH]) == 0
    assert seen == [7, 9]
    reports = json.loads(out.read_text())
    assert [r["constants"] for r in reports] == [
        {"vllm_rlt.bench.throughput.MAX_WAVES": 7},
        {"vllm_rlt.bench.throughput.MAX_WAVES": 9},
    ]
    assert all(r["report"]["results"][0]["concurrency"] == 1 for r in reports)
    assert capsys.readouterr().out.count(" c1 ") == 2


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("MAX_WAVES=1", "must be MODULE.CONSTANT=VALUE"),
        ("vllm_rlt.bench.throughput.NO_SUCH=1", "has no constant NO_SUCH"),
        ("vllm_rlt.bench.throughput.MAX_WAVES=os.system", "must be Python literals"),
    ],
)
def test_bad_settings_are_named(setting, message):
    with pytest.raises(SystemExit, match=message):
        ab_constants.main(["--set", setting, "--", *BENCH])
