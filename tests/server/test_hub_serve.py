"""`vllm-rlt serve OWNER/NAME` resolves the hub ID through the hub's cache (offline here)
and serves the model under that ID, with vLLM's flag names."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.server.conftest import _free_port, wait_healthy


def test_a_hub_id_is_served_under_its_name(hub_cache):
    port = _free_port()
    command = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "org/ouro-tasks"]
    command += ["--download-dir", str(hub_cache), "--port", str(port), "--trust-remote-code"]
    command += ["--max-model-len", "128", "--generation-config", "vllm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["org/ouro-tasks"]
        body = {"model": "org/ouro-tasks", "prompt": "347+589=", "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=60)
        assert reply.json()["choices"][0]["text"] == "936"
        too_long = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 200})
        assert too_long.status_code == 400 and "max_model_len" in too_long.text
    finally:
        process.kill()
        process.wait()
