"""The README's commands, run as written (install steps aside): every fenced bash command and
Python block outside the GPU section, with `vllm-rlt serve` running for the ones that talk
to it. Placeholders (`/path/to/...`) and CUDA commands are the only ones left out here; the
GPU commands run in the GPU test tier."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from tests.server.conftest import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GPU_SECTION = "## On a GPU"
SERVER = "http://127.0.0.1:8000"


def fenced_blocks(language: str) -> list[tuple[str, str]]:
    """(section heading, block text) of every ```language block."""
    blocks, section = [], ""
    for part in re.split(r"(?m)^(## .*)$", README):
        if part.startswith("## "):
            section = part.strip()
            continue
        blocks += [(section, b) for b in re.findall(rf"```{language}\n(.*?)```", part, re.S)]
    return blocks


def commands() -> list[tuple[str, str]]:
    """(section, command) for each logical line of every bash block, install steps removed."""
    found = []
    for section, block in fenced_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            steps = [s.strip() for s in line.split("&&") if not s.strip().startswith("pip ")]
            if steps:
                found.append((section, " && ".join(steps)))
    return found


def runnable(section: str, command: str) -> bool:
    code = re.split(r"\s+#", command)[0]  # a trailing comment may name a placeholder
    return (
        section != GPU_SECTION
        and "/path/to/" not in code
        and "--device cuda" not in code
        and not code.startswith("python -m pytest")  # the suite itself
    )


CPU_COMMANDS = [c for c in commands() if runnable(*c)]
SERVER_COMMANDS = [
    c for c in CPU_COMMANDS if "127.0.0.1:8000" in c[1] and not c[1].startswith("vllm-rlt serve")
]
SERVE_COMMAND = next(c for _, c in CPU_COMMANDS if c.startswith("vllm-rlt serve"))
OFFLINE_COMMANDS = [
    c
    for section, c in CPU_COMMANDS
    if (section, c) not in SERVER_COMMANDS and "vllm-rlt serve" not in c
]
QUICK_START = 'vllm-rlt generate --prompt "347+589="'


def chains(commands: list[str]) -> list[list[str]]:
    """`commands` split into chains that may run at the same time, each in README order: a
    command that names a file an earlier one writes (`--out NAME`, `--output NAME`) joins
    that command's chain, so it runs after it."""
    found: list[list[str]] = []
    writers: dict[str, list[str]] = {}
    for command in commands:
        words = shlex.split(command, comments=True)
        chain = next((writers[word] for word in words if word in writers), None)
        if chain is None:
            chain = []
            found.append(chain)
        chain.append(command)
        writers |= {name: chain for flag, name in pairwise(words) if flag in ("--out", "--output")}
    return found


def run_shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_readme_has_the_commands_this_test_expects():
    assert any(c.startswith("vllm-rlt generate --prompt") for _, c in CPU_COMMANDS)
    assert SERVE_COMMAND.split("#")[0].split() == ["vllm-rlt", "serve"]
    assert {c.split()[0] for _, c in SERVER_COMMANDS} == {"curl", "vllm-rlt", "lm_eval"}
    assert len(fenced_blocks("python")) == 3
    # the trained model and accuracy.json are each read by the command after their writer
    assert [len(chain) for chain in chains(OFFLINE_COMMANDS) if len(chain) > 1] == [2, 2]


def test_offline_commands_run_as_written(tmp_path):
    """Independent chains run two at a time (each command on one torch thread, as conftest
    sets for the processes tests start)."""
    assert OFFLINE_COMMANDS

    def run_chain(chain: list[str]) -> None:
        for command in chain:
            run = run_shell(command, tmp_path)
            assert run.returncode == 0, (command, run.stderr[-2000:])
            if command == QUICK_START:
                assert run.stdout == "347+589=936\n"

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run_chain, chains(OFFLINE_COMMANDS)))
    assert QUICK_START in OFFLINE_COMMANDS


def test_python_api_block_runs_as_written(tmp_path):
    section, block = fenced_blocks("python")[0]
    assert "LLM(" in block and section == "## Python API"
    run = run_shell(f"python -c {shlex.quote(block)}", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.endswith("\n33747\n"), run.stdout  # chat, greedy by the model's defaults


def test_coming_from_vllm_block_runs_as_written(tmp_path):
    section, block = fenced_blocks("python")[1]
    assert section == "## Python API" and "trust_remote_code=True" in block
    run = run_shell(f"python -c {shlex.quote(block)}", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("[") and run.stdout.count("'") == 8, run.stdout


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_server_commands_run_as_written(tmp_path):
    if not _port_free(8000):
        pytest.skip("port 8000, which the README's server commands use, is taken")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    server = subprocess.Popen(
        ["bash", "-c", f"exec {SERVE_COMMAND}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(SERVER, server)
        for _, command in SERVER_COMMANDS:
            # lm-eval's tasks name their files from the repository root, as the README says
            run = run_shell(command, ROOT if command.startswith("lm_eval") else tmp_path)
            assert run.returncode == 0, (command, run.stderr[-2000:])
            if command.startswith("lm_eval"):
                table = run.stdout.replace(" ", "")
                assert "|ouro_tasks_generate_depth1|1|none|0|exact_match|↑|0.325|" in table
            if command.startswith("curl"):
                assert '"text":"936"' in run.stdout.replace(" ", ""), run.stdout
            if command.startswith("vllm-rlt bench serve"):
                assert '"completed": 64' in run.stdout
        _, client_block = fenced_blocks("python")[2]
        assert "OpenAI(" in client_block
        run = run_shell(f"python -c {shlex.quote(client_block)}", tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        # chat renders the built-in model's trained form and decodes greedily by default
        assert run.stdout.split(" ", 1)[0] == "936", run.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_benchmark_commands_parse(tmp_path):
    """The GPU section's commands exist and accept their flags (each runs for minutes, so
    only --help is run here)."""
    for section, command in commands():
        if section == GPU_SECTION and "/path/to/" not in command:
            program = command.split("#")[0].split("--")[0].strip()
            run = run_shell(f"{program} --help", ROOT)
            assert run.returncode == 0, (command, run.stderr[-2000:])
