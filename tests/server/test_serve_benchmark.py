"""The serving benchmark runs against a live server and reports every figure."""

from __future__ import annotations

import json

from tests.server.conftest import wait_idle
from vllm_rlt.bench.serve import main


def test_serve_benchmark_reports_latency_percentiles(server, tmp_path, capsys):
    url, state = server
    out = tmp_path / "serve.json"
    args = ["--url", url, "--num-requests", "8", "--output-len", "5", "--prompt-len", "12"]
    assert (
        main(
            [
                *args,
                "--prompt-len-min",
                "4",
                "--request-rate",
                "100",
                "--poisson",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["completed"] == 8 and not report["failed"]
    assert report["output_tokens_per_s"] > 0 and report["request_throughput_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert 0 < report[key]["p50"] <= report[key]["p99"]
    wait_idle(state)
