"""Weights from a trainer in another process (engine/weight_sync.py): the trainer broadcasts
a checkpoint over a gloo group built apart from torch.distributed's default group, and the
engine then generates that checkpoint's greedy tokens; a bad update changes nothing."""

from __future__ import annotations

import json
import multiprocessing
import socket

import pytest
import torch

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.engine.weight_sync import send_weights, trainer_group, weight_specs
from vllm_rlt.models.toy import toy_config_dict, toy_weights

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [[5, 6, 7, 8] * 5]  # a full block or more: prefix-cached after the first run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def toy_folder(folder, seed: int) -> str:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(toy_config_dict()))
    save_file(toy_weights(seed), str(folder / "model.safetensors"))
    return str(folder)


def run_trainer(port: int, updates: list[list[tuple[str, torch.Tensor]]]) -> None:
    """The trainer's process: rank 0 of a two-rank group, one broadcast per tensor."""
    group = trainer_group("127.0.0.1", port, 2, backend="gloo")
    for weights in updates:
        send_weights(group, weights)


def bad_updates() -> list[tuple[list[tuple[str, torch.Tensor]], str]]:
    """Updates the engine must refuse, with what its error says: each also carries the
    right tensors, so a refusal that copied some of them would show."""
    new = list(toy_weights(2).items())
    norm = dict(new)["model.norm.weight"]
    return [
        (new[:3] + [("model.layers.0.mlp.nope.weight", norm)], "'model.layers.0.mlp.nope"),
        (new[:3] + [("model.norm.weight", torch.ones(3))], r"has shape \(3,\)"),
        (new[:3] + [("model.norm.weight", norm.double())], "has dtype torch.float64"),
    ]


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_trainer_process_broadcasts_a_checkpoint_over_gloo(tmp_path):
    want = tokens(LLM(model=toy_folder(tmp_path / "second", 2)))
    llm = LLM(model=toy_folder(tmp_path / "first", 1))
    before = tokens(llm)
    assert before != want and llm.engine.kv.num_cached_blocks > 0
    bad = bad_updates()
    good = list(toy_weights(2).items())
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=run_trainer, args=(port, [weights for weights, _ in bad] + [good])
    )
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        for weights, message in bad:
            with pytest.raises(ValueError, match=message) as caught:
                llm.update_weights_from_distributed(*weight_specs(weights), weight_version="bad")
            assert caught.value.param == "names"
            output = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
            assert list(output.outputs[0].token_ids) == before  # nothing was copied
            assert output.weight_version is None
        llm.update_weights_from_distributed(*weight_specs(good), weight_version="step-1")
        output = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
        assert list(output.outputs[0].token_ids) == want and output.weight_version == "step-1"
        assert llm.engine.kv.num_cached_blocks > 0  # filled again, under the new weights
    finally:
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def test_malformed_calls_are_refused_before_anything_is_received(tmp_path):
    """Nothing to receive without a group, and a list that does not describe tensors is
    refused before any broadcast is read; the group's own arguments name their ranges."""
    llm = LLM(model="toy")
    names, dtypes, shapes = weight_specs(toy_weights(2).items())
    for args, param, message in (
        ((names, dtypes[:-1], shapes), "names", "one entry per tensor"),
        ((names, ["float33"] + dtypes[1:], shapes), "dtypes", r"dtypes\[0\] must name"),
        ((names, dtypes, [[-1]] + shapes[1:]), "shapes", r"shapes\[0\] must be a list"),
        ((names, dtypes, shapes), "names", "init_weights_update_group first"),
    ):
        with pytest.raises(ValueError, match=message) as caught:
            llm.update_weights_from_distributed(*args)
        assert caught.value.param == param
    for kwargs, param, message in (
        ({"rank_offset": 0}, "rank_offset", r"rank_offset must be in \[1, 1\]"),
        ({"world_size": 1}, "world_size", r"world_size must be in \[2, 65536\]"),
        ({"master_port": 0}, "master_port", r"master_port must be in \[1, 65535\]"),
        ({"backend": "mpi"}, "backend", r"backend must be one of \['gloo', 'nccl'\]"),
        ({"backend": "nccl"}, "backend", "'nccl' needs CUDA tensors"),
    ):
        args = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1}
        with pytest.raises(ValueError, match=message) as caught:
            llm.init_weights_update_group(**{**args, "world_size": 2, **kwargs})
        assert caught.value.param == param


def test_update_weights_from_disk_swaps_in_a_checkpoint_folder(tmp_path):
    second = toy_folder(tmp_path / "second", 2)
    want = tokens(LLM(model=second))
    llm = LLM(model=toy_folder(tmp_path / "first", 1))
    with pytest.raises(ValueError, match="holds no .safetensors file") as caught:
        llm.update_weights_from_disk(str(tmp_path))
    assert caught.value.param == "model_path"
    llm.update_weights_from_disk(second, weight_version="disk-2")
    output = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == want and output.weight_version == "disk-2"


def test_weights_that_are_not_floating_point_are_refused_and_change_nothing(tmp_path):
    """A bool or int8 tensor would be cast into the model and ruin it silently."""
    import torch

    llm = LLM(model=toy_folder(tmp_path / "first", 1))
    want = tokens(llm)
    name, tensor = next(iter(llm.engine.model.checkpoint_views().items()))
    for dtype in (torch.bool, torch.int8):
        with pytest.raises(ValueError, match=f"{name} must be a floating-point tensor") as caught:
            llm.load_weights([(name, torch.zeros(tensor.shape, dtype=dtype))])
        assert caught.value.param == "weights"
    assert tokens(llm) == want


def test_leaving_a_join_ends_only_the_one_under_way():
    """WeightCalls.leave (AsyncLLM.abort_all, a shutdown) ends the wait of the join under way
    with its error; a join started afterwards waits for its answer as usual."""
    import asyncio

    from vllm_rlt.engine.rl_calls import WeightCalls

    class Core:  # answers "joining" once per join, then the join's result
        size = 1

        def __init__(self) -> None:
            self.asked = 0

        def call(self, name: str, timeout: float) -> dict:
            self.asked += 1
            return {"joining": True} if name.startswith("init_") else {}

    calls = WeightCalls(Core())
    args = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
    calls.leave(RuntimeError("left"))
    asyncio.run(calls.call("init_weights_update_group", dict(args)))  # a later join: answered
    assert calls.client.asked == 2

    async def left_while_waiting() -> None:
        waiting = asyncio.ensure_future(calls.call("init_weights_update_group", dict(args)))
        await asyncio.sleep(0)
        calls.leave(RuntimeError("left"))
        await waiting

    calls.client.call = lambda name, timeout: {"joining": True}
    with pytest.raises(RuntimeError, match="left"):
        asyncio.run(left_while_waiting())
