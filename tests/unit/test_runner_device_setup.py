"""The runner prepares its own device side: graph captures only where CUDA and the attention
backend allow them, then the warm-up; a failed set-up leaves no graphs behind, and timing
eager passes hands the graphs back afterwards. The CUDA side is stood in for (no device is
touched): the runner reads only the model's device type and whether the backend segments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _recording(runner, monkeypatch, fail_warm_up: bool = False) -> list[tuple]:
    calls: list[tuple] = []

    def capture(max_num_batched_tokens: int) -> None:
        calls.append(("capture", max_num_batched_tokens))
        runner.graphs, runner.mixed = object(), object()

    def warm_up(row_counts: list[int]) -> None:
        calls.append(("warm_up", row_counts))
        if fail_warm_up:
            raise RuntimeError("out of memory")

    monkeypatch.setattr(runner, "capture_graphs", capture)
    monkeypatch.setattr(runner, "warm_up_prompt_passes", warm_up)
    return calls


def _on_cuda(runner, monkeypatch, needs_segments: bool = False) -> None:
    monkeypatch.setattr(runner, "model", SimpleNamespace(device=torch.device("cuda")))
    monkeypatch.setattr(runner, "ops", SimpleNamespace(needs_segments=needs_segments))


def test_on_the_cpu_nothing_is_captured_or_warmed_up(make_engine, monkeypatch):
    runner = make_engine().runner
    calls = _recording(runner, monkeypatch)
    runner.prepare_device(cuda_graphs=True, max_num_batched_tokens=64)
    assert calls == [] and runner.graphs is None and runner.mixed is None


@pytest.mark.parametrize(
    ("cuda_graphs", "needs_segments", "captured"),
    [(True, False, True), (False, False, False), (True, True, False)],
)
def test_on_cuda_graphs_are_captured_where_allowed_then_passes_warm_up(
    make_engine, monkeypatch, cuda_graphs, needs_segments, captured
):
    runner = make_engine().runner
    calls = _recording(runner, monkeypatch)
    _on_cuda(runner, monkeypatch, needs_segments)
    runner.prepare_device(cuda_graphs, max_num_batched_tokens=64)
    capture = [("capture", 64)] if captured else []
    assert calls == [*capture, ("warm_up", [1, 64])]
    assert (runner.graphs is not None) == captured


def test_a_failed_set_up_leaves_no_graphs(make_engine, monkeypatch):
    runner = make_engine().runner
    _recording(runner, monkeypatch, fail_warm_up=True)
    _on_cuda(runner, monkeypatch)
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.prepare_device(cuda_graphs=True, max_num_batched_tokens=64)
    assert runner.graphs is None and runner.mixed is None


def test_eager_passes_hand_the_graphs_back(make_engine, monkeypatch):
    runner = make_engine().runner
    graphs, mixed = object(), object()
    monkeypatch.setattr(runner, "graphs", graphs)
    monkeypatch.setattr(runner, "mixed", mixed)
    with pytest.raises(RuntimeError), runner.eager_passes():
        assert runner.graphs is None and runner.mixed is None
        raise RuntimeError
    assert runner.graphs is graphs and runner.mixed is mixed
