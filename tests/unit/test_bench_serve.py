"""The serving load generator against the stub server (no inference): token counting, client
processes, the concurrency cap, goodput, the stub itself, and flag errors (CPU)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from vllm_rlt.bench import serve, serve_client
from vllm_rlt.bench.stub_server import STREAMS, Streams, build_app, start

SMALL = ["--num-requests", "12", "--output-len", "5", "--prompt-len", "6"]


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, Streams]]:
    """The stub on a free loopback port, served by an event loop in a thread of this process
    (so that a test can read how many streams were open at once)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app = build_app()
    runner, port = asyncio.run_coroutine_threadsafe(start(app, "127.0.0.1", 0), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}", app[STREAMS]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def run(argv: list[str], capsys) -> tuple[dict, str]:
    assert serve.main(argv) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_every_streamed_token_is_counted(stub, capsys):
    url, _ = stub
    report, err = run(["--url", url, *SMALL], capsys)
    assert report["model"] == "stub"  # asked of GET /v1/models
    assert report["completed"] == 12 and report["num_failed"] == 0 and report["failed"] == []
    assert report["total_output_tokens"] == 12 * 5
    assert report["total_input_tokens"] == 12 * 6
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        figures = report[key]
        if key == "itl_s" and figures["p50"] is None:
            continue  # a loaded machine may have read each stream whole: no gap to measure
        assert 0 <= figures["p50"] <= figures["p90"] <= figures["p99"]
        assert figures["mean"] >= 0
    assert report["output_tokens_per_s"] > 0 and report["request_throughput_per_s"] > 0
    assert report["launch"] is None and "goodput" not in report and "offline" not in report
    assert report["environment"]["vllm_rlt"] and report["environment"]["python"]
    assert report["command"].startswith("vllm-rlt bench serve ")
    assert "requests" in err and "12/12" in err


def test_tokens_are_the_exit_depths_of_each_event():
    lines = [
        b'data: {"choices": [{"index": 0, "text": "ab", "exit_depths": [4, 2]}]}',
        b"",
        b": a comment",
        b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}',
        b'data: {"choices": [], "usage": {"completion_tokens": 3}}',
        b'data: {"choices": [{"index": 0, "text": "c", "exit_depths": [1]}]}\r',
        b"data: [DONE]",
    ]
    assert serve_client.tokens_in(lines) == 3
    with pytest.raises(serve_client.StreamFailed, match="request timed out"):
        serve_client.tokens_in([b'data: {"error": {"message": "request timed out", "code": 504}}'])


def test_client_processes_share_the_requests(stub, capsys):
    url, _ = stub
    report, err = run(["--url", url, *SMALL, "--num-clients", "2", "--request-rate", "500"], capsys)
    assert report["workload"]["num_clients"] == 2
    assert report["workload"]["request_rate"] == 500
    assert report["completed"] == 12 and report["total_output_tokens"] == 12 * 5
    assert "12/12" in err


@pytest.mark.parametrize("clients", ["1", "2"])
def test_max_concurrency_caps_the_streams_open_at_once(stub, clients, capsys):
    url, streams = stub
    streams.peak = 0
    report, _ = run(
        ["--url", url, *SMALL, "--max-concurrency", "3", "--num-clients", clients], capsys
    )
    assert report["completed"] == 12 and report["workload"]["max_concurrency"] == 3
    assert 1 <= streams.peak <= 3


def test_goodput_counts_the_requests_that_met_every_objective(stub, capsys):
    url, _ = stub
    report, _ = run(["--url", url, *SMALL, "--goodput", "ttft:1e9", "tpot:1e9"], capsys)
    goodput = report["goodput"]
    assert goodput["slo_ms"] == {"ttft": 1e9, "tpot": 1e9}
    assert goodput["good_requests"] == 12
    assert goodput["requests_per_s"] == pytest.approx(report["request_throughput_per_s"])
    report, _ = run(["--url", url, *SMALL, "--goodput", "e2el:1e9", "ttft:0"], capsys)
    assert report["goodput"]["good_requests"] == 0  # no first token comes in no time
    assert report["goodput"]["requests_per_s"] == 0


def test_stub_is_launched_and_stopped(capsys):
    report, err = run(["--stub", "--num-requests", "6", "--output-len", "3"], capsys)
    assert report["completed"] == 6 and report["total_output_tokens"] == 18
    assert report["launch"]["stub"] is True and report["launch"]["exit_code"] == 0
    assert "stub server listening on http://127.0.0.1:" in err  # its output, on our stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--compare-offline"], "--compare-offline needs --launch"),
        (["--stub", "--compare-offline"], "--compare-offline needs --launch"),
        (["--", "--max-num-seqs", "8"], "need --launch"),
        (["--url", "http://x", "--launch", "toy"], "not allowed with"),
        (["--num-clients", "0"], "--num-clients"),
        (["--num-requests", "2", "--num-clients", "3"], "--num-clients"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--num-clients", "3", "--max-concurrency", "2"], "--max-concurrency"),
        (["--goodput", "ttft"], "NAME:MS"),
        (["--goodput", "latency:100"], "NAME:MS"),
        (["--goodput", "ttft:-1"], "NAME:MS"),
        (["--goodput", "ttft:inf"], "NAME:MS"),
        (["--goodput", "ttft:1", "ttft:2"], "each objective once"),
        (["--request-rate", "0"], "--request-rate"),
        (["--launch", "toy", "--", "--port", "9000"], "--host and --port"),
        (["--launch", "toy", "--", "--max-num-seqs", "many"], "--max-num-seqs"),
        (["--launch", "toy", "--", "--exit-mode", "trace"], "--exit-trace"),
        (["--launch", "no-such-model-folder"], "does not exist"),
    ],
)
def test_bad_flags_fail_in_one_line_before_any_request(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-rlt bench serve"), captured.err
    assert says in lines[0]
