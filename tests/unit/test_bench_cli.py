"""The bench commands' command lines, reports and progress bars, and LLM.generate's bar (CPU)."""

from __future__ import annotations

import json

import pytest

from vllm_rlt.bench import accuracy, serve, throughput
from vllm_rlt.engine.llm import LLM
from vllm_rlt.sampling_params import SamplingParams

BENCHES = {"throughput": throughput.main, "accuracy": accuracy.main, "serve": serve.main}
# Defaults each help screen must show, including what a None default means.
DEFAULT_SHOWN = {
    "throughput": ["(default: toy)", "(default: all of the model's loops)"],
    "accuracy": ["(default: 200)", "(default: last_exited)", "(default: the built-in"],
    "serve": [
        "(default: 64)",
        "(default: ask the server",
        "(default: http://127.0.0.1:8000)",
        "(default: no limit)",
        "(default: 1)",
    ],
}


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_help_shows_the_defaults(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        BENCHES[name](["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())  # help lines wrap
    assert f"vllm-rlt bench {name}" in text
    for shown in DEFAULT_SHOWN[name]:
        assert shown in flat
    assert "(default: stdout only)" in flat
    assert "DESIGN" not in text  # no citations of documents the repository does not have
    # The description's example commands stay one per line.
    examples = [line for line in text.splitlines() if line.lstrip().startswith("vllm-rlt bench")]
    assert len(examples) >= 2


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_bad_flag_fails_in_one_line(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        BENCHES[name](["--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vllm-rlt bench {name}: error: ")


def test_throughput_reports_the_settings_that_ran_on_cpu(capsys):
    argv = ["--shape", "toy", "--device", "cpu", "--concurrency", "1", "--output-len", "4"]
    argv += ["--prompt-len", "4", "--repeats", "1", "--warmup", "0", "--no-baseline"]
    assert throughput.main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    workload = report["workload"]
    assert workload["cuda_graphs"] is False  # asked for (no --enforce-eager), never on CPU
    assert workload["async_scheduling"] is True
    assert workload["attention_backend"] == "torch"
    assert workload["attention_backend_requested"] == "auto"
    (result,) = report["results"]
    assert result["execution"] == {
        "cuda_graphs": False,
        "async_scheduling": True,
        "attention_backend": "torch",
        "exit_sync_passes": 1,  # Ouro-shaped: no layers after the loop
    }
    assert result["kv_pool"] == "every request at once" and result["engine"]["max_running"] == 1
    (only_run,) = result["engine_runs_decode_tokens_per_s"]  # one timed run, its own median
    assert result["engine_median_decode_tokens_per_s"] == only_run
    # toy: 2 layers x 4 planes x K and V x 2 heads x 16 dims x 4 bytes
    assert result["kv_bytes_per_position"] == 2 * 4 * 2 * 2 * 16 * 4
    assert "concurrency 1: engine" in captured.err and "1/1" in captured.err  # the bar


def test_throughput_runs_fp8_weights_and_kv_against_an_unquantized_baseline(capsys):
    argv = ["--shape", "toy", "--device", "cpu", "--concurrency", "2", "--output-len", "3"]
    argv += ["--prompt-len", "4", "--repeats", "1", "--warmup", "0"]
    argv += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["quantization"] == "fp8"
    assert report["workload"]["kv_cache_dtype"] == "fp8"
    (result,) = report["results"]
    assert result["kv_bytes_per_position"] == 2 * 4 * 2 * 2 * 16 * 1  # one byte per value
    assert result["engine"]["decode_tokens_per_s"] > 0
    assert result["baseline"]["decode_tokens_per_s"] > 0  # the naive model, unquantized


@pytest.mark.parametrize("depth", [None, 3])
def test_throughput_runs_a_huginn_shape_at_a_fixed_depth_against_its_baseline(depth, capsys):
    """A fixed depth holds under Huginn's own exit policy too (its latent criterion would
    stop a random model early), and the baseline is the family's."""
    argv = ["--shape", "huginn-toy", "--device", "cpu", "--concurrency", "2"]
    argv += ["--output-len", "3", "--prompt-len", "4", "--repeats", "1", "--warmup", "0"]
    argv += [] if depth is None else ["--depth", str(depth)]
    assert throughput.main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["engine"]["mean_loops"] == (depth or 8)  # the shape's mean_recurrence
    assert result["baseline"]["decode_tokens_per_s"] > 0
    assert result["execution"]["exit_sync_passes"] == 2  # the default for a coda model


def test_throughput_takes_and_reports_an_exit_sync_for_huginn_shapes(capsys):
    argv = ["--shape", "huginn-toy", "--device", "cpu", "--concurrency", "2", "--no-baseline"]
    argv += ["--output-len", "3", "--prompt-len", "4", "--repeats", "1", "--warmup", "0"]
    assert throughput.main([*argv, "--depth-trace-mean", "4", "--exit-sync-passes", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["exit_sync_passes"] == 3
    assert "--exit-sync-passes 3" in report["command"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        throughput.main([*argv, "--exit-sync-passes", "0"])
    assert "--exit-sync-passes must be in [1, 256], got 0" in capsys.readouterr().err


def test_throughput_reports_async_scheduling_off_in_no_refill_mode(capsys):
    argv = ["--device", "cpu", "--concurrency", "1", "--output-len", "2", "--prompt-len", "2"]
    argv += ["--repeats", "1", "--warmup", "0", "--no-baseline", "--mode", "no_refill"]
    assert throughput.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["async_scheduling"] is False


def test_accuracy_runs_with_the_kv_layout_asked_for(monkeypatch, capsys):
    engines = []

    class SpyLLM(LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self.engine)

    monkeypatch.setattr("vllm_rlt.engine.llm.LLM", SpyLLM)
    argv = ["--model", "toy", "--per-task", "1", "--train-size", "4", "--thresholds", "0.5"]
    assert accuracy.main([*argv, "--kv-layout", "shared"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["kv_layout"] == "shared"
    assert [engine.cache_config.layout for engine in engines] == ["shared"]
    settings = [row["setting"] for row in report["rows"]]
    assert settings == ["depth 1", "depth 2", "depth 3", "depth 4", "ouro q=0.5"]
    # one problem per task: its only choice is the right one
    assert report["loglikelihood_accuracy"] == {task: 1.0 for task in accuracy.TASKS}
    for setting in settings:  # one progress bar per setting, named after it
        assert f"{setting}: 100%" in captured.err


@pytest.fixture(scope="module")
def toy_llm() -> LLM:
    return LLM(model="toy")


def test_generate_shows_a_bar_only_for_more_than_one_prompt(toy_llm, capfd):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    capfd.readouterr()
    toy_llm.generate("one prompt", params)
    toy_llm.generate("one prompt, two samples", SamplingParams(max_tokens=2, n=2, seed=0))
    toy_llm.generate(["a", "b"], params, use_tqdm=False)
    assert capfd.readouterr().err == ""
    toy_llm.generate(["a", "b"], params)
    captured = capfd.readouterr()
    assert "Generating" in captured.err and "2/2" in captured.err
    assert "Generating" not in captured.out


@pytest.mark.parametrize("caching", [True, False])
def test_throughput_with_a_shared_prefix_finds_it_cached(caching, capsys):
    argv = ["--shape", "toy", "--device", "cpu", "--concurrency", "2", "--output-len", "2"]
    argv += ["--prompt-len", "3", "--shared-prefix-len", "32", "--repeats", "1", "--no-baseline"]
    if not caching:
        argv.append("--no-enable-prefix-caching")
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["shared_prefix_len"] == 32
    assert report["workload"]["enable_prefix_caching"] is caching
    assert ("--no-enable-prefix-caching" in report["command"]) is not caching
    (result,) = report["results"]
    # The warm-up run caches the prefix's 2 blocks; the timed run finds them (2 x 32 of 70).
    assert result["prefix_cache_hit_rate"] == (pytest.approx(64 / 140) if caching else 0.0)


def test_throughput_max_tokens_above_the_output_ends_requests_early(capsys):
    argv = ["--shape", "toy", "--device", "cpu", "--concurrency", "2", "--output-len", "3"]
    argv += ["--prompt-len", "4", "--max-tokens", "50", "--repeats", "1", "--no-baseline"]
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["max_tokens"] == 50 and report["workload"]["output_len"] == 3
    (result,) = report["results"]
    assert result["full_reservation_at_once"] == 2  # the CPU pool holds both at full length
    engine = result["engine"]
    tokens = round(engine["end_to_end_tokens_per_s"] * engine["wall_s"])
    # 2 requests x 3 tokens; asynchronous scheduling may let one more each out before the stop
    assert 6 <= tokens <= 8
    bad = [*argv[:-5], "--max-tokens", "2"]
    with pytest.raises(SystemExit) as exited:
        throughput.main(bad)
    assert exited.value.code == 2
    assert "--max-tokens must be >= --output-len (3), got 2" in capsys.readouterr().err


def test_throughput_samples_with_the_filters_asked_for(monkeypatch, capsys):
    """--temperature / --top-p / --top-k reach every request (a pass with a filtering row
    runs the filtered sampler), are reported, and a value out of range is a one-line error
    before any model is built."""
    from vllm_rlt.ops.torch_ops import TorchOps

    calls = []
    sample = TorchOps.sample_filtered
    monkeypatch.setattr(
        TorchOps, "sample_filtered", lambda *a, **k: calls.append(1) or sample(*a, **k)
    )
    argv = ["--shape", "toy", "--device", "cpu", "--concurrency", "2", "--output-len", "4"]
    argv += ["--repeats", "1", "--warmup", "0", "--no-baseline", "--temperature", "0.8"]
    assert throughput.main([*argv, "--top-p", "0.7", "--top-k", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["workload"]["top_p"], report["workload"]["top_k"]) == (0.7, 5)
    assert "--temperature 0.8" in report["command"] and calls
    for flag, value, field in (("--top-p", "0", "top_p"), ("--top-k", "-2", "top_k")):
        with pytest.raises(SystemExit) as exited:
            throughput.main([*argv, flag, value])
        assert exited.value.code == 2
        assert f"error: {field}" in capsys.readouterr().err


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_throughput_with_replayed_speculation(capsys, rate):
    """--spec-acceptance-rate makes random weights accept drafts at the rate asked for."""
    argv = ["--device", "cpu", "--concurrency", "2", "--output-len", "9", "--prompt-len", "3"]
    argv += ["--repeats", "1", "--warmup", "0", "--no-baseline", "--speculative-tokens", "2"]
    argv += ["--spec-acceptance-rate", str(rate)]
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["speculative_tokens"] == 2
    assert report["results"][0]["spec_acceptance_rate"] == rate


def test_throughput_waves_refill_slots_from_a_queue(capsys):
    """--waves 3 sends 3 x concurrency requests through concurrency slots; the baseline
    still runs one static batch."""
    argv = ["--device", "cpu", "--concurrency", "2", "--output-len", "3", "--prompt-len", "4"]
    argv += ["--repeats", "1", "--warmup", "0", "--waves", "3", "--depth-trace-mean", "2.5"]
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["waves"] == 3
    (result,) = report["results"]
    engine = result["engine"]
    assert engine["max_running"] == 2
    assert round(engine["end_to_end_tokens_per_s"] * engine["wall_s"]) == 6 * 3
    assert engine["decode_window"] == "first first token to end"
    assert result["baseline"]["decode_tokens_per_s"] > 0
    with pytest.raises(SystemExit) as exited:
        throughput.main([*argv[:-4], "--waves", "0"])
    assert exited.value.code == 2
    assert "--waves must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        throughput.main([*argv[:-4], "--waves", str(10**12)])
    assert exited.value.code == 2
    assert f"--waves must be in [1, 1000], got {10**12}" in capsys.readouterr().err


def test_bench_serve_without_its_client_library_says_which_extra_in_one_line(monkeypatch, capsys):
    """Its help still answers; a run stops with one line naming the extra."""
    import sys

    import vllm_rlt.bench
    import vllm_rlt.bench.serve  # noqa: F401 - loaded for real first: teardown puts these back
    from vllm_rlt.entrypoints.cli import main

    for name in ("serve", "serve_client", "serve_launch"):  # imported again without aiohttp
        monkeypatch.delitem(sys.modules, f"vllm_rlt.bench.{name}")
        monkeypatch.delattr(vllm_rlt.bench, name)
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    with pytest.raises(SystemExit) as shown:
        main(["bench", "serve", "--help"])
    assert shown.value.code == 0 and "--num-requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "serve", "--url", "http://127.0.0.1:9"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("vllm-rlt bench serve: error: needs aiohttp")
    assert 'pip install "vllm-rlt[serve]"' in err
    with pytest.raises(SystemExit) as stopped:  # a sweep of served points, before any server
        main(["bench", "sweep", "--launch", "toy", "--concurrency", "1"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("vllm-rlt bench sweep: error: needs aiohttp")


def test_every_switch_shows_its_default_as_on_or_off(capsys):
    from vllm_rlt.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for switch, default in [
        ("--access-log, --no-access-log", "off"),
        ("--exit-on-load-error, --no-exit-on-load-error", "on"),
        ("--enable-sleep-mode", "off"),
        ("--enforce-eager", "off"),
    ]:
        help_text = flat.split(switch + " ", 1)[1].split(" --", 1)[0]
        assert help_text.count("(default:") == 1, (switch, help_text)
        assert f"(default: {default})" in help_text, (switch, help_text)
