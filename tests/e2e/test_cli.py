"""The `vllm-rlt` command line: JSON output, prompt sources, the implicit `generate`, exit
traces, and one-line errors with exit code 2.

Runs that generate (or start a server) are real subprocesses; each pays the torch import
(~2 s), so they start together, two at a time, in one module fixture, and the tests only
read their results. Parse and validation errors and help screens end before anything is
generated, so they call `main` in this process."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_rlt.entrypoints.cli import main
from vllm_rlt.models.load import DEFAULT_MODEL_DIR

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
    "priority_under_fcfs": (["--priority", "2"], "--scheduling-policy priority"),
    "unknown_scheduling_policy": (["--scheduling-policy", "lifo"], "scheduling-policy"),
    "presence_penalty_out_of_range": (["--presence-penalty", "5"], "presence_penalty"),
    "prompt_logprobs_out_of_range": (["--prompt-logprobs", "21"], "prompt_logprobs"),
}
HELP_SCREENS = {
    "help": ["--help"],
    "help_bench": ["bench", "--help"],
    "help_generate": ["generate", "--help"],
    "help_serve": ["serve", "--help"],
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(args: list[str | bytes], stdin: str | None = None) -> subprocess.CompletedProcess:
    """A real run (on one torch thread, as conftest sets for every process a test starts)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", *args],
        cwd=REPO_ROOT,
        input=stdin or "",
        capture_output=True,
        text=True,
        timeout=120,
    )


def _main(argv: list[str], capsys, caplog) -> subprocess.CompletedProcess:
    """`main(argv)` in this process, as a finished run; log records of WARNING and above
    count as stderr lines, as a real run prints them there."""
    capsys.readouterr()
    caplog.clear()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return subprocess.CompletedProcess(argv, code, out, err + "".join(f"{m}\n" for m in logged))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "trace.json"
    path.write_text(json.dumps(TRACE))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, trace_file) -> dict[str, subprocess.CompletedProcess]:
    jobs: dict[str, tuple[list[str], str | None]] = {
        "flags": (["generate", *PROMPTS, *BASE], None),
        "stdin_implicit_generate": ([*BASE], "hi\n\nhello\n"),
        "trace": (
            [*PROMPTS, *BASE, "--ignore-eos", "--exit-mode", "trace"]
            + ["--exit-trace", str(trace_file)],
            None,
        ),
    }
    no_weights = tmp_path_factory.mktemp("no-weights")
    shutil.copy(DEFAULT_MODEL_DIR / "config.json", no_weights / "config.json")
    jobs |= {
        "serve_unloadable_weights": (["serve", str(no_weights), "--port", str(_free_port())], None),
        "untrained_prompt": (["generate", "--prompt", "1000*1=", "--max-tokens", "4"], None),
        "trained_prompt": (["generate", "--prompt", "347+589=", "--no-progress"], None),
        "logprobs": (
            ["generate", "--prompt", "347+589=", *BASE, "--logprobs", "1", "--prompt-logprobs"]
            + ["2", "--repetition-penalty", "1.2"],
            None,
        ),
        "surrogate_prompt": (["generate", "--prompt", b"ab\xff", "--model", "toy"], None),
        "long_untrained_prompt": (["generate", "--prompt", "z" * 5000, "--max-tokens", "1"], None),
        "speculation": (
            ["generate", "--prompt", "347+589=", *BASE, "--speculative-tokens", "2"]
            + ["--exit-threshold", "1"],
            None,
        ),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
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


def test_json_with_logprobs_and_prompt_logprobs(runs):
    [record] = _records(runs["logprobs"])
    ids = record["prompt_token_ids"]
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == len(ids)
    for token, entry in zip(ids[1:], record["prompt_logprobs"][1:], strict=True):
        assert str(token) in entry and len(entry) in (2, 3)  # JSON keys are strings
    assert len(record["logprobs"]) == len(record["token_ids"])
    for token, entry in zip(record["token_ids"], record["logprobs"], strict=True):
        assert str(token) in entry


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_exit_2_with_one_line(trace_file, capsys, caplog, name):
    flags = [str(trace_file) if f == "TRACE_FILE" else f for f in ERRORS[name][0]]
    run = _main(["generate", "--prompt", "hi", *BASE, *flags], capsys, caplog)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("vllm-rlt generate: error: ")
    assert ERRORS[name][1] in lines[0]


def test_serve_with_a_missing_model_folder_exits_2(capsys, caplog):
    """As `generate` does: one error line, exit code 2, found before the server starts."""
    run = _main(["serve", "/nonexistent", "--port", str(_free_port())], capsys, caplog)
    assert run.returncode == 2, run.stderr
    last = run.stderr.splitlines()[-1]
    assert last.startswith("vllm-rlt serve: error: "), run.stderr
    assert run.stderr.splitlines() == [
        "vllm-rlt serve: error: model folder '/nonexistent' does not exist"
    ]


def test_serve_with_weights_that_cannot_load_exits_2(runs):
    """As `generate` does: one error line, exit code 2, when the background load fails (the
    server has started by then: a real process)."""
    run = runs["serve_unloadable_weights"]
    assert run.returncode == 2, run.stderr
    last = run.stderr.splitlines()[-1]
    assert last.startswith("vllm-rlt serve: error: "), run.stderr
    assert "safetensors" in last and "Traceback" not in run.stderr


def test_untrained_prompts_get_a_warning(runs):
    warned, plain = runs["untrained_prompt"], runs["trained_prompt"]
    assert warned.returncode == 0 and plain.returncode == 0
    assert "warning: 1 prompt(s), such as '1000*1='" in warned.stderr
    assert "(5000 chars)" in runs["long_untrained_prompt"].stderr  # shortened, not echoed
    assert "a*b= with a in 1000..9999, b in 2..9" in warned.stderr
    assert plain.stdout == "347+589=936\n" and "warning" not in plain.stderr


def test_a_prompt_that_is_not_valid_text_is_a_one_line_error(runs):
    run = runs["surrogate_prompt"]
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "vllm-rlt generate: error: --prompt: prompt 1 is not valid UTF-8 text (at character 2)"
    ]


def test_help_screens_list_everything_and_show_defaults(monkeypatch, capsys, caplog):
    monkeypatch.setenv("COLUMNS", "80")  # the width a real run gets when writing to a pipe
    runs = {name: _main(argv, capsys, caplog) for name, argv in HELP_SCREENS.items()}
    for name in HELP_SCREENS:
        assert runs[name].returncode == 0, runs[name].stderr
        assert "§" not in runs[name].stdout and "DESIGN" not in runs[name].stdout
    assert "accuracy" in runs["help"].stdout and "bench" in runs["help"].stdout
    bench = runs["help_bench"].stdout
    assert all(f"vllm-rlt bench {name}" in bench for name in ("throughput", "serve", "accuracy"))
    generate = runs["help_generate"].stdout
    assert "(default: 32)" in generate and "(default: last_exited)" in generate
    serve = runs["help_serve"].stdout
    assert "(default: 8000)" in serve and "(default: 256)" in serve


def test_serve_without_the_serve_extra_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "needs the serve extra" in lines[0] and "uvicorn" in lines[0]


def test_speculation_reports_its_acceptance_after_the_records(runs):
    """Speculation (here at fixed depth 4, so every decode token is drafted) keeps greedy
    text and adds one final JSON line of draft and accepted token counts."""
    *records, last = _records(runs["speculation"])
    assert [record["text"] for record in records] == ["936"]
    figures = last["speculation"]
    drafted, accepted = figures["draft_tokens"], figures["accepted_tokens"]
    assert 1 <= drafted <= 3 and 0 <= accepted <= drafted
    assert figures["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert sum(figures["accepted_per_position"]) == accepted
    assert "speculation" not in runs["speculation"].stderr


LIGHT_COMMANDS = """
import contextlib, io, json, sys
from vllm_rlt.entrypoints.cli import main
results = {}
for argv in %r:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results[" ".join(argv)] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""
HELP_COMMANDS = [
    ["--help"],
    ["generate", "--help"],
    ["serve", "--help"],
    ["bench", "throughput", "--help"],
    ["bench", "serve", "--help"],
    ["bench", "accuracy", "--help"],
]
TYPOS = {
    "--promt x": "vllm-rlt generate: error: unrecognized arguments: --promt x "
    "(did you mean --prompt?)",
    "generate --promt=x --max-tokns 2": "vllm-rlt generate: error: unrecognized arguments: "
    "--promt=x --max-tokns 2 (did you mean --prompt, --max-tokens?)",
    "serve --prot=8000": "vllm-rlt serve: error: unrecognized arguments: --prot=8000 "
    "(did you mean --port?)",
    "bench throughput --devce cpu": "vllm-rlt bench throughput: error: unrecognized "
    "arguments: --devce cpu (did you mean --device?)",
}


def test_help_and_flag_typos_answer_without_loading_torch():
    """Help screens and mistyped flags are answered before anything heavy is imported; a
    typo is named by its subcommand, with the closest flag suggested."""
    argvs = HELP_COMMANDS + [typo.split() for typo in TYPOS]
    run = subprocess.run(
        [sys.executable, "-c", LIGHT_COMMANDS % argvs],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["torch"] is False
    results = report["results"]
    for argv in HELP_COMMANDS:
        result = results[" ".join(argv)]
        assert result["code"] == 0 and result["err"] == "", result
        assert result["out"].startswith("usage: ")
    for typo, line in TYPOS.items():
        assert results[typo] == {"code": 2, "out": "", "err": line + "\n"}
