"""benchmarks/rollout.py, the RL rollout measurement, on the toy model: one JSON line per KV
layout, every sample run to max_tokens with --ignore-eos, no preemption in a pool that fits."""

from __future__ import annotations

import json

import pytest

from benchmarks.rollout import main


def test_rollout_reports_each_layout(capsys):
    argv = ["toy", "--device", "cpu", "--dtype", "float32", "--num-prompts", "2"]
    argv += ["--prompt-len", "5", "--n", "3", "--max-tokens", "7", "--ignore-eos"]
    argv += ["--kv-layout", "last_exited", "shared_decode"]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kv_layout"] for r in records] == ["last_exited", "shared_decode"]
    for record in records:
        assert record["output_tokens"] == 2 * 3 * 7
        assert record["preemptions"] == 0 and record["passes"] > 0
        assert record["command"].startswith("python -m benchmarks.rollout toy")


def test_rollout_time_limit_reports_the_tokens_made_until_then(capsys):
    argv = ["toy", "--device", "cpu", "--dtype", "float32", "--num-prompts", "2"]
    argv += ["--prompt-len", "5", "--n", "3", "--max-tokens", "4000", "--ignore-eos"]
    argv += ["--time-limit", "0.5"]
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["complete"] is False
    assert record["output_tokens"] < 2 * 3 * 4000


def test_rollout_takes_a_float8_cache(capsys):
    argv = ["toy", "--device", "cpu", "--dtype", "float32", "--num-prompts", "1"]
    argv += ["--prompt-len", "4", "--n", "2", "--max-tokens", "5", "--ignore-eos"]
    argv += ["--kv-cache-dtype", "fp8"]
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["kv_cache_dtype"] == "fp8" and record["output_tokens"] == 2 * 5


def test_rollout_time_limit_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["toy", "--device", "cpu", "--time-limit", "nan"])
    assert "--time-limit must be > 0" in capsys.readouterr().err
