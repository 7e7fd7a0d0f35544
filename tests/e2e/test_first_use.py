"""First use, typed as a user would: a mistyped command, a hub model that cannot be had
(offline, with an empty hub cache), and the repository's benchmark scripts run from another
folder or without Triton. Each answers in one line, never a traceback. The commands are
real processes, run two at a time in one module fixture; the tests read their results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_MODEL = "ByteDance/Ouro-1.4B"
OFFLINE_COMMANDS = {
    "generate": ["generate", "--model", HUB_MODEL, "--prompt", "x"],
    "serve": ["serve", "--model", HUB_MODEL],
    "bench accuracy": ["bench", "accuracy", "--model", HUB_MODEL],
    "bench sweep": ["bench", "sweep", "--launch", HUB_MODEL],
}
# Triton made unimportable whether or not it is installed, as on a machine without it.
WITHOUT_TRITON = (
    "import runpy, sys; sys.modules['triton'] = None; sys.argv[0] = 'kernel_registers'; "
    "runpy.run_module('benchmarks.kernel_registers', run_name='__main__', alter_sys=True)"
)
REPORT = {
    "benchmark": "accuracy",
    "model": "ouro-tasks",
    "per_task": 2,
    "rows": [{"setting": "depth 1", "mean_loops": 1.0, "exact_match": {"add": 0.5}}],
}


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "accuracy.json").write_text(json.dumps(REPORT))
    env = {**os.environ, "HF_HOME": str(tmp_path_factory.mktemp("hf-home"))}
    env["HF_HUB_OFFLINE"] = "1"
    cli = shutil.which("vllm-rlt", path=str(Path(sys.executable).parent))
    assert cli is not None, "the package's console script is not installed"
    script = str(REPO_ROOT / "benchmarks" / "plot_accuracy.py")
    jobs = {
        "typo": ([cli, "gnerate", "--prompt", "x"], elsewhere),
        "bench typo": ([cli, "bench", "thruput"], elsewhere),
        "kernel_registers": ([sys.executable, "-c", WITHOUT_TRITON], REPO_ROOT),
        "plot in the root": (
            [sys.executable, "-m", "benchmarks.plot_accuracy", str(elsewhere / "accuracy.json")],
            REPO_ROOT,
        ),
        "plot elsewhere": ([sys.executable, script, "accuracy.json"], elsewhere),
        "plot a missing report": ([sys.executable, script, "missing.json"], elsewhere),
    }
    jobs |= {name: ([cli, *argv], elsewhere) for name, argv in OFFLINE_COMMANDS.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, *job, env) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, run.stderr
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    return run.stderr.rstrip("\n")


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("typo", "vllm-rlt: error: unknown command 'gnerate'; did you mean 'generate'?"),
        (
            "bench typo",
            "vllm-rlt bench: error: unknown benchmark 'thruput'; did you mean 'throughput'?",
        ),
    ],
)
def test_a_mistyped_subcommand_suggests_the_closest(runs, name, line):
    assert _one_error_line(runs[name]) == line


def test_a_hub_model_that_cannot_be_had_is_one_line(runs):
    """Offline with an empty cache, every command that takes a model says which and why in
    one line and exits 2, as serve does (`bench sweep --launch` before it starts a server)."""
    for name in OFFLINE_COMMANDS:
        line = _one_error_line(runs[name])
        assert line.startswith(f"vllm-rlt {name}: error: model '{HUB_MODEL}' ")
        assert "nor in the hub cache" in line and "HF_HUB_OFFLINE is set" in line


def test_kernel_registers_without_triton_says_to_install_it(runs):
    line = _one_error_line(runs["kernel_registers"])
    assert line.startswith("python -m benchmarks.kernel_registers: error: needs Triton")
    assert line.endswith("pip install triton")


def test_plot_accuracy_runs_from_the_root_and_by_its_path_from_anywhere(runs):
    table = "| depth 1 | 1.00 | 50.0 | 50.0 |"
    for name in ("plot in the root", "plot elsewhere"):
        assert runs[name].returncode == 0, runs[name].stderr
        assert table in runs[name].stdout.splitlines()
    line = _one_error_line(runs["plot a missing report"])
    assert line.endswith("error: cannot read missing.json: No such file or directory")
