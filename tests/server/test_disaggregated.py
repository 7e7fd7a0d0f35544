"""`vllm-rlt serve --disaggregate 1:1`: a prefill core runs each prompt and hands the
request's K/V to a decode core through shared memory. Clients see ordinary responses equal
to the offline engine's (seeded streams, greedy completions with n > 1 and prompt
logprobs, chat); a client that leaves mid-stream frees everything on both cores; a dead
decode core turns /health to 503 naming it while the prefill core serves on alone."""

from __future__ import annotations

import glob
import os
import re
import signal
import time

import httpx
import pytest

from tests.server.conftest import check_concurrent_streams, log_until, serve_process
from tests.server.test_data_parallel import _descendants, _health_until, samples
from vllm_rlt import LLM, CacheConfig, SamplingParams

_CORE_PIDS = re.compile(r"1 prefill and 1 decode engine cores \(pid (\d+), (\d+)\)")


def _pool_files() -> set[str]:
    return set(glob.glob("/dev/shm/vllm-rlt-kv-*"))


def _idle(url: str, timeout: float = 60.0) -> None:
    """Both cores report no running request and an empty KV cache."""
    deadline = time.monotonic() + timeout
    while True:
        running = samples(url, "vllm_rlt:num_requests_running")
        usage = samples(url, "vllm_rlt:kv_cache_usage_perc")
        if set(running) == {"0", "1"} and not any(running.values()) and not any(usage.values()):
            return
        assert time.monotonic() < deadline, (running, usage)
        time.sleep(0.05)


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_disaggregated_serving_equals_offline_and_frees_both_cores(layout):
    before = _pool_files()
    flags = ("--disaggregate", "1:1", "--kv-layout", layout, "--shutdown-timeout", "5")
    # Chunks of 8: the prompt's first block of 16 moves while its last chunk runs.
    flags += ("--prefill-chunk-size", "8")
    with serve_process(*flags) as (process, url):
        if layout == "last_exited":  # against the offline engine's default layout
            check_concurrent_streams(url, 6, max_tokens=8)

        llm = LLM(model="toy", cache_config=CacheConfig(layout=layout))
        prompt = "the quick brown fox"
        body = {"model": "toy", "prompt": prompt, "max_tokens": 7}
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
            # echo with logprobs: the prompt's logprobs, computed on the prefill core
            reply = httpx.post(
                f"{url}/v1/completions",
                json={**body, **sampling, "n": 2, "echo": True, "logprobs": 1},
                timeout=60,
            ).json()
            offline = llm.generate(
                [prompt], SamplingParams(max_tokens=7, n=2, prompt_logprobs=1, **sampling)
            )[0]
            texts = [choice["text"] for choice in reply["choices"]]
            assert texts == [prompt + c.text for c in offline.outputs], sampling
            served = reply["choices"][0]["logprobs"]["token_logprobs"]
            expected = [None] + [
                entry[token].logprob
                for token, entry in zip(
                    offline.prompt_token_ids[1:], offline.prompt_logprobs[1:], strict=True
                )
            ]
            prompt_part = served[: len(expected)]
            assert prompt_part[0] is None
            assert prompt_part[1:] == pytest.approx(expected[1:], abs=1e-4)

        chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}]}
        chat_reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={**chat, "max_tokens": 6, "temperature": 0},
            timeout=60,
        ).json()
        assert chat_reply["choices"][0]["finish_reason"] == "length"

        # A client that leaves mid-stream: both cores end with nothing held.
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={**body, "max_tokens": 3000, "ignore_eos": True, "stream": True, "seed": 1},
            timeout=60,
        ) as stream:
            for index, _ in enumerate(stream.iter_lines()):
                if index > 6:
                    break
        _idle(url)
        assert samples(url, "vllm_rlt:passes_total").keys() == {"0", "1"}
        scrape = httpx.get(f"{url}/metrics").text
        handovers = re.search(r"^vllm_rlt:kv_transfer_handovers_total (\S+)$", scrape, re.M)
        moved = re.search(r"^vllm_rlt:kv_transfer_bytes_total (\S+)$", scrape, re.M)
        # the six streams (last_exited), two n = 2 requests, the chat and the stream that
        # left
        assert float(handovers.group(1)) == (10 if layout == "last_exited" else 4)
        assert float(moved.group(1)) > 0
        early = re.search(r"^vllm_rlt:kv_transfer_prefetched_blocks_total (\S+)$", scrape, re.M)
        assert float(early.group(1)) > 0  # chunks of 8: blocks moved early in both layouts
        assert re.search(r"^vllm_rlt:kv_transfer_queue 0\.0$", scrape, re.M)
        assert "vllm_rlt:kv_transfer_seconds_count" in scrape
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert _pool_files() <= before, "pool files were left behind"


def _tensor_parallel_rank(core_pid: int) -> int:
    """The process of a core's second tensor-parallel rank (not a helper such as
    multiprocessing's resource tracker)."""
    for pid in _descendants(core_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"resource_tracker" not in cmdline.read():
                return pid
    raise AssertionError(f"engine core {core_pid} has no other rank")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_dead_decode_core_is_named_and_the_prefill_core_serves_on(ranks):
    """The decode core's process, or with two tensor-parallel ranks its other rank while
    the core idles, is killed: /health names the core at once (not at the next request),
    and the prefill core serves on alone."""
    flags = ("--disaggregate", "1:1", "--tensor-parallel-size", str(ranks))
    with serve_process(*flags, "--shutdown-timeout", "5") as (process, url):
        log = log_until(process, _CORE_PIDS.search)
        _, decode_pid = (int(pid) for pid in _CORE_PIDS.search(log).groups())
        victim = decode_pid if ranks == 1 else _tensor_parallel_rank(decode_pid)
        os.kill(victim, signal.SIGKILL)
        health = _health_until(url, 503)
        assert "engine core 1" in health.text
        body = {"model": "toy", "prompt": "go on", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"


def _long_prompt_equals_offline(url: str, layout: str) -> None:
    """Greedy and seeded n = 2 completions of a prompt of several blocks equal the offline
    engine's; then both cores hold nothing."""
    llm = LLM(model="toy", cache_config=CacheConfig(layout=layout))
    prompt = "a long enough prompt to fill more than one block of sixteen positions " * 2
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
        body = {"model": "toy", "prompt": prompt, "max_tokens": 9, "n": 2, **sampling}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        offline = llm.generate([prompt], SamplingParams(max_tokens=9, n=2, **sampling))[0]
        assert [c["text"] for c in reply["choices"]] == [c.text for c in offline.outputs]
    _idle(url)


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_the_nixl_connector_serves_what_the_offline_engine_does(layout):
    """`--kv-connector nixl` (where the nixl package is installed): the decode core reads
    the prefill core's blocks through NIXL; greedy and seeded n = 2 equal the offline
    engine, and both cores end with nothing held."""
    pytest.importorskip("nixl._api")
    flags = ("--disaggregate", "1:1", "--kv-connector", "nixl", "--kv-layout", layout)
    with serve_process(*flags, "--shutdown-timeout", "5") as (process, url):
        log = ""
        while "; ready" not in log:
            line = process.stderr.readline()
            assert line, f"the server's log ended early:\n{log}"
            log += line
        assert "K/V through nixl; ready" in log
        _long_prompt_equals_offline(url, layout)
        scrape = httpx.get(f"{url}/metrics").text
        assert re.search(r"^vllm_rlt:kv_transfer_handovers_total 2\.0$", scrape, re.M)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


@pytest.mark.parametrize(
    ("layout", "connector"),
    [("last_exited", "torch"), ("shared_decode", "torch"), ("shared_decode", "nixl")],
)
def test_tensor_parallel_cores_hand_over_as_one_process_would(layout, connector):
    """`--disaggregate 1:1 --tensor-parallel-size 2`: each core splits the model over two
    processes, and rank r of the decode core reads rank r of the prefill core's pool (the
    same heads; through nixl where installed). A prompt run in chunks of 8 moves blocks
    early; greedy and seeded n = 2 completions equal the one-process offline engine's, both
    cores end with nothing held, and SIGTERM ends every process."""
    if connector == "nixl":
        pytest.importorskip("nixl._api")
    flags = ("--disaggregate", "1:1", "--tensor-parallel-size", "2", "--kv-layout", layout)
    flags += ("--kv-connector", connector, "--prefill-chunk-size", "8", "--shutdown-timeout", "5")
    with serve_process(*flags) as (process, url):
        _long_prompt_equals_offline(url, layout)
        scrape = httpx.get(f"{url}/metrics").text
        assert re.search(r"^vllm_rlt:kv_transfer_handovers_total 2\.0$", scrape, re.M)
        early = re.search(r"^vllm_rlt:kv_transfer_prefetched_blocks_total (\S+)$", scrape, re.M)
        assert early and float(early.group(1)) > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
