"""Scheduler settings left unset are sized to the device for the entry point, every set
one is kept, the choice is one logged line; and `vllm-rlt bench sweep` reports a grid."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vllm_rlt.bench import sweep
from vllm_rlt.config import ParamError, SchedulerConfig
from vllm_rlt.engine import device_defaults
from vllm_rlt.engine.device_defaults import DEFAULTS, size_scheduler

CPU = torch.device("cpu")


def _fake_gpu(monkeypatch, gib: float) -> torch.device:
    props = SimpleNamespace(
        name="Fake GPU", total_memory=int(gib * 2**30), multi_processor_count=132
    )
    monkeypatch.setattr(device_defaults.torch.cuda, "get_device_properties", lambda _: props)
    return torch.device("cuda", 0)


def test_the_cpu_keeps_small_passes_and_set_fields_are_kept():
    config, note = size_scheduler(SchedulerConfig(), CPU)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 2048)
    assert config.max_prefill_batches_before_decode == 4
    assert note.startswith("scheduler sized for the CPU, offline use: max_num_seqs=64")
    config, _ = size_scheduler(SchedulerConfig(max_num_seqs=8, prefill_chunk_size=32), CPU)
    assert (config.max_num_seqs, config.prefill_chunk_size) == (8, 32)
    explicit = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=9,
        max_prefill_batches_before_decode=1,
        admission_scan_limit=3,
    )
    assert size_scheduler(explicit, CPU) == (explicit, "scheduler set by its flags")
    # the scan alone unset: it is sized, and the note names it
    config, note = size_scheduler(replace(explicit, admission_scan_limit=None), CPU)
    assert config == replace(explicit, admission_scan_limit=64)
    assert note.endswith("offline use: admission_scan_limit=64 (flags override)")


@pytest.mark.parametrize(("gib", "kind"), [(141, "large gpu"), (24, "gpu")])
@pytest.mark.parametrize("usage", ["offline", "serve"])
def test_a_gpu_gets_its_class_defaults_for_the_entry_point(monkeypatch, gib, kind, usage):
    device = _fake_gpu(monkeypatch, gib)
    config, note = size_scheduler(SchedulerConfig(), device, usage)
    want = DEFAULTS[(kind, usage)]
    assert config.max_num_seqs == want.max_num_seqs
    assert config.max_num_batched_tokens == want.max_num_batched_tokens
    assert config.max_prefill_batches_before_decode == want.max_prefill_batches_before_decode
    assert config.admission_scan == want.admission_scan_limit
    # a large GPU's server admits a burst together; offline batches go in cohorts of 64
    assert want.admission_scan_limit == (256 if (kind, usage) == ("large gpu", "serve") else 64)
    assert f"Fake GPU ({gib} GiB, 132 SMs" in note and f"{usage} use" in note


def test_an_explicit_field_keeps_the_defaults_consistent(monkeypatch):
    """More sequences than the default's rows still get a row each, and fewer rows than the
    default's sequences cap them."""
    device = _fake_gpu(monkeypatch, 141)
    config, _ = size_scheduler(SchedulerConfig(max_num_seqs=40000), device)
    assert config.max_num_batched_tokens == 40000
    config, _ = size_scheduler(SchedulerConfig(max_num_batched_tokens=100), device)
    assert config.max_num_seqs == 100


def test_bad_values_name_their_field():
    with pytest.raises(ParamError, match="max_num_seqs must be in"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="usage_context must be one of offline, serve"):
        size_scheduler(SchedulerConfig(), CPU, "batch")


def test_sweep_reports_every_point_and_the_best(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["--concurrency", "2", "3", "--max-num-seqs", "auto", "4"]
    argv += ["--max-num-batched-tokens", "auto", "--max-prefill-batches-before-decode", "auto"]
    argv += ["--prefill-chunk-size", "auto"]
    argv += ["--prompt-len", "4", "--output-len", "3", "--repeats", "1", "--warmup", "0"]
    assert sweep.main([*argv, "--num-blocks", "64", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert [point["asked"]["max_num_seqs"] for point in report["results"]] == [None, 4]
    assert report["results"][0]["settings"]["max_num_seqs"] == 64  # the CPU default
    assert report["results"][0]["settings"]["admission_scan_limit"] == 64  # sized too
    assert len(report["rows"]) == 4 and {r["concurrency"] for r in report["rows"]} == {2, 3}
    assert all(
        row["tokens_per_s"] > 0 and row["ttft_s_p99"] >= row["ttft_s_p50"] for row in report["rows"]
    )
    assert report["best"] in report["results"]
    assert set(report["auto_vs_best"]) == {"2", "3"}


def test_the_default_sweep_compares_auto_and_runs_each_setting_once(monkeypatch, capsys):
    """The default grid has the all-`auto` point, so `auto_vs_best` is reported; points
    that resolve to the same settings on the device (on the CPU, auto max_num_batched_tokens
    is 2048) run once, the others listed under `also_asked`."""
    measured = []

    def fake_measure(self, point):
        measured.append(point)
        figures = dict.fromkeys(sweep.METRICS, 0.5) | {"tokens_per_s": float(len(measured))}
        return dict(point), {str(c): figures for c in self.args.concurrency}

    monkeypatch.setattr(sweep.OfflinePoints, "measure", fake_measure)
    assert sweep.main(["--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    auto, *_ = report["results"]
    assert set(auto["asked"].values()) == {None}
    resolved = [size_scheduler(sweep.scheduler_config(point), CPU)[0] for point in measured]
    assert len(set(resolved)) == len(measured) == 18
    asked = [p for result in report["results"] for p in (result["asked"], *result["also_asked"])]
    assert len(asked) == 3 * 4 * 3 and measured == [r["asked"] for r in report["results"]]
    assert report["auto_vs_best"] == {"64": 1 / 18, "256": 1 / 18}  # the last point was best
    # a server's auto API-server count on the CPU is 1: asking for both runs it once
    served = [dict(auto["asked"], api_server_count=n) for n in (None, 1)]
    assert sweep.distinct_points(served, CPU, "serve") == [served]


def test_sweep_flags_out_of_range_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    assert "--max-num-seqs: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--max-num-seqs", "64", "--max-num-batched-tokens", "8"])
    assert "no point where max_num_batched_tokens >= max_num_seqs" in capsys.readouterr().err


def test_sweep_launches_a_server_per_point(tmp_path, capsys, monkeypatch):
    """With --launch, a point starts `vllm-rlt serve MODEL` once with its flags (auto: none)
    and runs every concurrency's load against it."""
    from vllm_rlt.bench import serve_launch

    launches = []
    real_launched = serve_launch.launched

    def counted(command, extra, info):
        launches.append(extra)
        return real_launched(command, extra, info)

    monkeypatch.setattr(serve_launch, "launched", counted)
    out = tmp_path / "served.json"
    argv = ["--launch", "toy", "--concurrency", "1", "2", "--max-num-seqs", "4"]
    argv += ["--max-num-batched-tokens", "auto", "--max-prefill-batches-before-decode", "auto"]
    argv += ["--api-server-count", "1", "--num-clients", "1"]
    argv += ["--prompt-len", "4", "--output-len", "2", "--repeats", "1", "--output", str(out)]
    assert sweep.main(argv) == 0
    assert launches == [["--max-num-seqs", "4", "--api-server-count", "1"]]
    report = json.loads(out.read_text())
    assert report["target"] == "vllm-rlt serve toy" and report["usage"] == "serve"
    assert report["environment"]["python"] and "torch" in report["environment"]
    assert [row["concurrency"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["max_num_seqs"] == 4 and row["max_num_batched_tokens"] is None
        assert row["api_server_count"] == 1
        assert row["tokens_per_s"] > 0 and row["ttft_s_p99"] >= row["ttft_s_p50"] > 0


def test_sweep_api_server_count_needs_a_server(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--api-server-count", "2"])
    assert "--api-server-count sizes a server: it needs --launch MODEL" in capsys.readouterr().err


def test_api_servers_are_sized_to_the_host():
    """Left out, --api-server-count is one on the CPU or with cores elsewhere, and on a GPU
    one per four CPU cores, at most four."""
    from vllm_rlt.entrypoints.cli import auto_api_server_count

    assert auto_api_server_count("cpu", False, cpus=64) == 1
    assert auto_api_server_count("cuda", True, cpus=64) == 1
    assert [auto_api_server_count("cuda:1", False, cpus=n) for n in (1, 4, 8, 16, 128)] == [
        1,
        1,
        2,
        4,
        4,
    ]
