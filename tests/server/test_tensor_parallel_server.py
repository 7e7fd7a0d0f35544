"""`vllm-rlt serve --tensor-parallel-size 2`: the engine core splits the model over two
processes; concurrent streams equal the one-process offline engine's, and SIGTERM ends the
server with exit code 0."""

from __future__ import annotations

import signal

from tests.server.conftest import check_concurrent_streams, serve_process


def test_a_split_model_serves_what_one_process_generates_and_stops_cleanly():
    with serve_process("--tensor-parallel-size", "2", "--shutdown-timeout", "5") as (
        process,
        url,
    ):
        check_concurrent_streams(url, 6, max_tokens=8)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, process.stderr.read()
