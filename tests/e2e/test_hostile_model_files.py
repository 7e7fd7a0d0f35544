"""A model folder's own files, made hostile one value at a time: config.json and
generation_config.json values of the wrong type, nested without end, too large for any
device, NaN, infinite, or token ids outside the vocabulary. Each must be one line naming the
file, the field and its range, found before anything large is allocated: never a
traceback, a signal, a huge allocation, or a server that starts and then fails requests.

The table runs in this process, through the check `generate` and `serve` make before they
load anything and through `LLM`; a few cases run the real command line, the ones whose
sizes were once allocated under a 4 GiB address-space limit."""

from __future__ import annotations

import json
import logging
import re
import resource
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from vllm_rlt import LLM
from vllm_rlt.models.generation_defaults import sampling_defaults
from vllm_rlt.models.load import DEFAULT_MODEL_DIR, check_model_source

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG, GENERATION = "config.json", "generation_config.json"
NAN, INF = float("nan"), float("inf")
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads recurses once per level
ADDRESS_SPACE_LIMIT = 4 * 2**30
HUGE_SHAPE = {
    "vocab_size": 2**24,
    "hidden_size": 2**20,
    "intermediate_size": 2**20,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def _cases(file: str, key: str, values: list[Any], pattern: str) -> list[Any]:
    return [
        pytest.param(file, {key: value}, pattern, id=f"{file}:{key}={value!r}"[:60])
        for value in values
    ]


def _int_range(key: str, high: int) -> str:
    return rf"{key} must be an integer in \[1, {high}\]"


CASES = [
    *_cases(CONFIG, "model_type", [["ouro"], {"ouro": 1}], "unknown model_type .*ouro"),
    *_cases(
        CONFIG,
        "rms_norm_eps",
        [None, [1e-6], NAN, INF, 0, -1e-6, "1e-6", True],
        r"rms_norm_eps must be a number in \(0, 1\]",
    ),
    *_cases(
        CONFIG,
        "early_exit_threshold",
        [None, [0.5], NAN, -INF, 1.5],
        r"early_exit_threshold must be a number in \[0, 1\]",
    ),
    *_cases(CONFIG, "rope_theta", [0, -10000.0, NAN, INF], r"rope_theta must be a number in \[1, "),
    *_cases(
        CONFIG, "layer_types", [3, "full_attention", [None]], "layer_types must all be .*, got"
    ),
    *_cases(
        CONFIG,
        "num_hidden_layers",
        [10**9, 1e9, 0, -3, True, "3", None],
        _int_range("num_hidden_layers", 1024),
    ),
    *_cases(CONFIG, "total_ut_steps", [10**9, 0, 4.0], _int_range("total_ut_steps", 64)),
    *_cases(
        CONFIG,
        "max_position_embeddings",
        [10**12, 1e12, 0],
        _int_range("max_position_embeddings", 2**24),
    ),
    *_cases(CONFIG, "hidden_size", [2**40, "192", 0], _int_range("hidden_size", 2**20)),
    *_cases(CONFIG, "vocab_size", [10**12, 0, [259]], _int_range("vocab_size", 2**24)),
    *_cases(CONFIG, "intermediate_size", [-1, NAN], _int_range("intermediate_size", 2**20)),
    *_cases(CONFIG, "num_attention_heads", [0, 10**9], _int_range("num_attention_heads", 4096)),
    *_cases(
        CONFIG,
        "head_dim",
        [31, 0, 10**6, 32.0],
        r"head_dim must be an even integer in \[2, 1024\]",
    ),
    *_cases(
        CONFIG,
        "eos_token_id",
        [5000, -1, 1e30, "x", [0, 5000], [[0]], True, {"id": 0}],
        r"eos_token_id must be a token id in \[0, 258\]",
    ),
    *_cases(CONFIG, "bos_token_id", [5000], r"bos_token_id must be a token id in \[0, 258\]"),
    *_cases(CONFIG, "pad_token_id", ["x"], r"pad_token_id must be a token id in \[0, 258\]"),
    *_cases(CONFIG, "tie_word_embeddings", ["false", 1], "tie_word_embeddings must be true or"),
    *_cases(CONFIG, "use_sliding_window", ["no"], "use_sliding_window must be false"),
    *_cases(
        CONFIG,
        "quantization_config",
        [{"quant_method": "fp8", "ignored_layers": 5}],
        "ignored_layers must be a list",
    ),
    pytest.param(
        CONFIG,
        HUGE_SHAPE,
        r"a model of this shape \(vocab_size=16777216, hidden_size=1048576.*\) needs at "
        r"least [0-9.]+ GiB in float32; cpu has [0-9.]+ GiB",
        id="config.json:weights beyond memory",
    ),
    pytest.param(CONFIG, DEEP, "invalid JSON: nested too deeply", id="config.json:deep"),
    pytest.param(
        CONFIG,
        '{"model_type": "ouro", "architectures": ' + DEEP + "}",
        "invalid JSON: nested too deeply",
        id="config.json:deep value",
    ),
    *_cases(
        GENERATION,
        "temperature",
        [-1, NAN, INF, -INF, "0.7", True, [0.7]],
        r"temperature must be (a number )?in \[0\.0, 100\.0\]",
    ),
    *_cases(GENERATION, "top_p", [2, 0, NAN, -INF], r"top_p must be .*in [\[(]0(\.0)?, 1(\.0)?\]"),
    *_cases(
        GENERATION,
        "top_k",
        [-5, INF, 2.5, "x", True],
        r"top_k must be (an integer: )?0 or -1 \(every token\) or in \[1, 2147483647\]",
    ),
    *_cases(GENERATION, "min_p", [5, -0.1, NAN], r"min_p must be (a number )?in \[0\.0, 1\.0\]"),
    *_cases(
        GENERATION,
        "repetition_penalty",
        [0, -1, 1e9, NAN],
        r"repetition_penalty must be .*in \[1e-30, 10\.0\]",
    ),
    *_cases(GENERATION, "do_sample", ["false", 0], "do_sample must be true or false"),
    *_cases(
        GENERATION,
        "eos_token_id",
        [5000, [2, 5000], -1],
        r"eos_token_id -?\d+ is outside the vocabulary \[0, 259\)",
    ),
    *_cases(
        GENERATION,
        "eos_token_id",
        [1e30, "x", True],
        "eos_token_id must be an int or a list of ints",
    ),
    pytest.param(GENERATION, DEEP, "nested too deeply", id="generation_config.json:deep"),
    pytest.param(GENERATION, "[1, 2]", "must hold a JSON object", id="generation_config.json:list"),
]


def hostile_folder(root: Path, file: str, edit: dict[str, Any] | str) -> Path:
    """The built-in model's folder (its files linked) with `file` edited: keys changed, or
    replaced by raw text."""
    folder = root / "model"
    folder.mkdir()
    for source in DEFAULT_MODEL_DIR.iterdir():
        if source.name != file:
            (folder / source.name).symlink_to(source)
    if isinstance(edit, str):
        (folder / file).write_text(edit)
    else:
        data = json.loads((DEFAULT_MODEL_DIR / file).read_text())
        (folder / file).write_text(json.dumps({**data, **edit}))
    return folder


def assert_names(message: str, file: str, pattern: str) -> None:
    """One short line naming the file, then the field and its range."""
    assert "\n" not in message and len(message) < 400, message
    named = re.search(rf"(^|[/ ]){re.escape(file)}: ", message)
    assert named, f"{file} not named: {message}"
    assert re.search(pattern, message[named.end() :]), message


@pytest.mark.parametrize(("file", "edit", "pattern"), CASES)
def test_hostile_value_is_one_line_naming_file_and_field(tmp_path, file, edit, pattern):
    folder = hostile_folder(tmp_path, file, edit)
    with pytest.raises(ValueError) as checked:  # what generate and serve run first
        check_model_source(folder)
    assert_names(str(checked.value), file, pattern)
    with pytest.raises(ValueError) as loaded:
        LLM(model=str(folder))
    assert_names(str(loaded.value), file, pattern)


def test_ignoring_invalid_sampling_defaults_keeps_the_valid_ones(tmp_path, caplog):
    """With the flag (the LLM keyword) a bad field is left unset with a warning; vLLM's
    top_k of -1 (no top-k) is a valid one."""
    edit = {"temperature": -1, "top_p": NAN, "top_k": -1, "min_p": 0.05, "do_sample": True}
    folder = hostile_folder(tmp_path, GENERATION, edit)
    check_model_source(folder, generation_config_ignore_invalid=True)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(folder), generation_config_ignore_invalid=True)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (
        1.0,
        1.0,
        0,
        0.05,
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all(GENERATION in m for m in warned), warned
    assert "temperature must be in [0.0, 100.0], got -1" in warned[0]
    assert sampling_defaults(folder) == {"top_k": 0, "min_p": 0.05}


# ------------------------------------------------------------------------ the real CLI
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _cli(args: list[str], limited: bool) -> subprocess.CompletedProcess:
    """A real run; one still going after the timeout (a server that started) is a result
    too, so that it fails its own case."""
    command = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", *args]
    try:
        return subprocess.run(
            command,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_limit_address_space if limited else None,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(
            command, None, "", f"still running after {exc.timeout} s"
        )


# name: (command, file, edit, under the address-space limit, what the line must hold)
CLI_CASES: dict[str, tuple[str, str, dict[str, Any] | str, bool, str]] = {
    "layers_1e9": (
        "generate",
        CONFIG,
        {"num_hidden_layers": 10**9},
        True,
        _int_range("num_hidden_layers", 1024),
    ),
    "positions_1e12": (
        "generate",
        CONFIG,
        {"max_position_embeddings": 10**12},
        True,
        _int_range("max_position_embeddings", 2**24),
    ),
    "loops_1e9": ("generate", CONFIG, {"total_ut_steps": 10**9}, True, "total_ut_steps"),
    "deep_config": ("generate", CONFIG, DEEP, False, "nested too deeply"),
    "negative_temperature": ("generate", GENERATION, {"temperature": -1}, False, "temperature"),
    "serve_eos_outside_vocab": ("serve", CONFIG, {"eos_token_id": 5000}, False, "eos_token_id"),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every CLI case at once, two at a time (each pays the torch import)."""
    jobs = {}
    for name, (command, file, edit, limited, _) in CLI_CASES.items():
        folder = hostile_folder(tmp_path_factory.mktemp(name), file, edit)
        args = [command, "--model", str(folder)]
        args += ["--port", str(_free_port())] if command == "serve" else ["--prompt", "1+1="]
        jobs[name] = (args, limited)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_cli, *job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_refuses_with_one_line_and_exit_code_2(cli_runs, name):
    command, file, _, _, pattern = CLI_CASES[name]
    run = cli_runs[name]
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])  # not a signal, not 1
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(f"vllm-rlt {command}: error: "), lines[0]
    assert_names(lines[0], file, pattern)
