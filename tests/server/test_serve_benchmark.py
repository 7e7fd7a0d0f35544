"""The serving benchmark runs against a live server and reports every figure."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.server.conftest import _free_port, running_server, wait_idle
from vllm_rlt.bench.serve import main

SMALL = ["--num-requests", "4", "--output-len", "3", "--prompt-len", "6"]


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
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report == json.loads(captured.out)
    assert report["model"] == "toy"  # no --model: the one the server lists
    assert report["completed"] == 8 and not report["failed"] and report["num_failed"] == 0
    assert report["total_output_tokens"] == 8 * 5  # every token, counted by its exit depth
    assert report["output_tokens_per_s"] > 0 and report["request_throughput_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert 0 < report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    assert "requests" in captured.err and "8/8" in captured.err  # the progress bar
    wait_idle(state)


@pytest.fixture(scope="module")
def renamed_server():
    """A server whose model is not called "toy", behind an API key."""
    with running_server(served_model_name="looped-renamed", api_key="sesame") as running:
        yield running


def test_serve_benchmark_asks_the_server_for_its_model(renamed_server, capsys):
    url, state = renamed_server
    assert main(["--url", f"{url}/", "--api-key", "sesame", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "looped-renamed"
    assert report["completed"] == 4 and not report["failed"]
    wait_idle(state)


def test_serve_benchmark_explicit_model_is_used_as_given(renamed_server, capsys):
    url, state = renamed_server
    assert main(["--url", url, "--api-key", "sesame", "--model", "nope", *SMALL]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "nope" and report["completed"] == 0
    assert report["num_failed"] == 4
    assert report["failed"] and all("HTTP 404" in error for error in report["failed"])
    wait_idle(state)


def _fails_in_one_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_serve_benchmark_without_a_server_fails_in_one_line(capsys):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    line = _fails_in_one_line(["--url", url, *SMALL], capsys)
    assert line.startswith("vllm-rlt bench serve: error: ")
    assert f"{url}/v1/models" in line and "refused" in line.lower()


def test_serve_benchmark_reports_the_servers_refusal_in_one_line(renamed_server, capsys):
    url, _ = renamed_server
    line = _fails_in_one_line(["--url", url, *SMALL], capsys)  # no API key: 401
    assert f"{url}/v1/models" in line and "HTTP 401" in line


def test_serve_benchmark_launches_the_server_and_compares_it_with_offline(capsys):
    argv = ["--launch", "toy", "--compare-offline", *SMALL, "--", "--max-num-seqs", "8"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["model"] == "toy" and report["completed"] == 4 and not report["failed"]
    assert report["total_output_tokens"] == 4 * 3
    assert report["command"] == shlex.join(["vllm-rlt", "bench", "serve", *argv])
    launch = report["launch"]
    assert launch["model"] == "toy" and launch["server_flags"] == ["--max-num-seqs", "8"]
    assert launch["exit_code"] == 0 and launch["ready_s"] > 0  # stopped by SIGTERM, cleanly
    assert report["url"].startswith("http://127.0.0.1:")
    assert report["environment"]["torch"] and report["environment"]["cpu"]
    offline = report["offline"]
    assert offline["total_output_tokens"] == 4 * 3
    assert offline["output_tokens_per_s"] > 0 and offline["ttft_s"]["p50"] > 0
    ratio = report["ratio"]
    assert ratio["output_tokens_per_s"] == pytest.approx(
        report["output_tokens_per_s"] / offline["output_tokens_per_s"]
    )
    assert ratio["ttft_p50"] == pytest.approx(report["ttft_s"]["p50"] / offline["ttft_s"]["p50"])
    assert "4/4" in captured.err and "offline" in captured.err  # both progress bars


def test_serve_benchmark_fails_early_when_the_launched_server_exits(capsys):
    assert main(["--launch", "toy", *SMALL, "--", "--no-such-server-flag"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--no-such-server-flag" in captured.err  # the server's own complaint, relayed
    assert captured.err.splitlines()[-1] == (
        "vllm-rlt bench serve: error: the launched server exited with code 2 before it was ready"
    )
