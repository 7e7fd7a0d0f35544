"""The `vllm-rlt` command line, run as a real subprocess: JSON output, prompt sources, the
implicit `generate`, exit traces, and one-line errors with exit code 2.

Each run pays the torch import (~2 s), so all runs start together, a few at a time, in one
module fixture, and the tests only read their results."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = ["--max-tokens", "4", "--json"]
PROMPTS = ["--prompt", "hi", "--prompt", "hello"]
TRACE = [[4, 1, 3, 2], [4, 2, 2, 4]]

ERRORS = {
    "max_loops_above_depth": (["--max-loops", "99"], "max_loops"),
    "min_above_max_loops": (["--min-loops", "3", "--max-loops", "2"], "min_loops"),
    "missing_trace_file": (
        ["--exit-mode", "trace", "--exit-trace", "/nonexistent/trace.json"],
        "/nonexistent/trace.json",
    ),
    "trace_without_trace_mode": (["--exit-trace", "TRACE_FILE"], "--exit-mode trace"),
    "exclusive_kv_sizing": (
        ["--num-blocks", "4", "--kv-cache-memory-bytes", "100"],
        "not allowed with",
    ),
    "negative_temperature": (["--temperature", "-1"], "temperature"),
    "unknown_kv_layout": (["--kv-layout", "nope"], "kv-layout"),
}


def _cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", *args],
        cwd=REPO_ROOT,
        input=stdin or "",
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    trace_file = tmp_path_factory.mktemp("cli") / "trace.json"
    trace_file.write_text(json.dumps(TRACE))
    jobs: dict[str, tuple[list[str], str | None]] = {
        "flags": (["generate", *PROMPTS, *BASE], None),
        "stdin_implicit_generate": ([*BASE], "hi\n\nhello\n"),
        "trace": (
            [*PROMPTS, *BASE, "--ignore-eos", "--exit-mode", "trace"]
            + ["--exit-trace", str(trace_file)],
            None,
        ),
    }
    for name, (flags, _) in ERRORS.items():
        flags = [str(trace_file) if f == "TRACE_FILE" else f for f in flags]
        jobs[f"error_{name}"] = (["generate", "--prompt", "hi", *BASE, *flags], None)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_cli, args, stdin) for name, (args, stdin) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _records(run: subprocess.CompletedProcess) -> list[dict]:
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_json_line_per_prompt(runs):
    records = _records(runs["flags"])
    assert [r["prompt"] for r in records] == ["hi", "hello"]
    for record in records:
        assert {"text", "token_ids", "exit_depths", "finish_reason"} <= set(record)
        assert isinstance(record["text"], str)
        assert 1 <= len(record["token_ids"]) <= 4
        assert len(record["exit_depths"]) == len(record["token_ids"])
        assert record["exit_depths"][0] == 4
        assert record["finish_reason"] in ("stop", "length")
        if record["finish_reason"] == "length":
            assert len(record["token_ids"]) == 4
    assert records[0]["token_ids"] != records[1]["token_ids"]


def test_stdin_prompts_and_implicit_generate(runs):
    """Prompts from stdin lines (blank lines skipped), without the `generate` word, give the
    same records as --prompt flags (greedy is the CLI default)."""
    assert _records(runs["stdin_implicit_generate"]) == _records(runs["flags"])


def test_exit_trace_by_prompt_index(runs):
    records = _records(runs["trace"])
    assert [r["exit_depths"] for r in records] == TRACE
    assert all(r["finish_reason"] == "length" for r in records)


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_exit_2_with_one_line(runs, name):
    run = runs[f"error_{name}"]
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("vllm-rlt generate: error: ")
    assert ERRORS[name][1] in lines[0]
