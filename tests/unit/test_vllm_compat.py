"""Code written for vLLM runs with only its import changed: vLLM's `LLM` arguments, hub IDs
resolved through the hub's cache, skip_tokenizer_init, max_model_len and generation_config."""

from __future__ import annotations

import textwrap

import pytest

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.engine.vllm_args import apply_vllm_args
from vllm_rlt.worker.model_runner import ModelRunner

ROLLOUT = """
from vllm_rlt import LLM, SamplingParams

llm = LLM(model=path, trust_remote_code=True, dtype=dtype, max_model_len=L, enforce_eager=True,
          skip_tokenizer_init=True, seed=seed)
outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                    SamplingParams(n=8, temperature=1.0, top_p=0.7, max_tokens=30,
                                   stop_token_ids=[eos], skip_special_tokens=False))
"""


def test_a_vllm_rollout_script_runs_with_only_its_import_changed():
    scope = {"path": "toy", "dtype": "float32", "L": 128, "seed": 7, "eos": 2}
    scope["prompts"] = [[5, 6, 7], [8, 9, 10, 11]]
    exec(textwrap.dedent(ROLLOUT), scope)
    outs = scope["outs"]
    assert len(outs) == 2 and all(len(o.outputs) == 8 for o in outs)
    for output in outs:
        for completion in output.outputs:
            assert completion.text == "" and 0 < len(completion.token_ids) <= 30
            assert completion.finish_reason in ("stop", "length")
    llm = scope["llm"]
    assert llm.tokenizer is None and llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="exceeds the context length 128"):
        llm.generate([{"prompt_token_ids": [5] * 125}], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="pass prompt_token_ids instead of text"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="stop needs the model's tokenizer") as caught:
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))
    assert caught.value.param == "stop"
    assert llm.engine.all_blocks_free() and not llm.engine.has_unfinished


def test_vllm_arguments_land_in_the_configs_and_unknown_ones_are_named():
    llm = LLM(
        model="toy",
        seed=11,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        block_size=8,
        gpu_memory_utilization=0.5,
    )
    scheduler = llm.engine.scheduler.config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, 64)
    assert not llm.engine.kv.enable_caching and llm.engine.cache_config.block_size == 8
    cache, _, execution = apply_vllm_args(
        {"enforce_eager": True, "seed": 3, "kv_cache_dtype": "fp8"}, None, None, None
    )
    assert (execution.cuda_graphs, execution.seed, cache.block_size) == (False, 3, 16)
    assert cache.kv_cache_dtype == "fp8"
    for name, value in (("cpu_offload_gb", 4), ("swap_space", 4)):
        with pytest.raises(ValueError, match=f"argument '{name}', which this engine") as caught:
            LLM(model="toy", **{name: value})
        assert caught.value.param == name
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 4096\]"):
        LLM(model="toy", max_model_len=5000)


def test_hub_ids_resolve_through_the_cache_offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model="org/ouro-tasks", download_dir=str(hub_cache))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert llm.generate("347+589=", greedy)[0].outputs[0].text == "936"
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        LLM(model="org/absent", download_dir=str(hub_cache))
    with pytest.raises(ValueError, match="revision applies to Hugging Face hub IDs"):
        LLM(model="toy", revision="main")


def test_generation_config_picks_the_sampling_defaults(tmp_path):
    """auto: the model's file (the built-in model is greedy); vllm: the engine's own
    defaults; a folder: that folder's file."""
    assert LLM().get_default_sampling_params().temperature == 0.0
    assert LLM(generation_config="vllm").get_default_sampling_params().temperature == 1.0
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    folder = LLM(model="toy", generation_config=str(tmp_path)).get_default_sampling_params()
    assert (folder.temperature, folder.top_p) == (0.6, 0.9)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        LLM(model="toy", generation_config="nowhere")


def test_the_command_line_takes_vllms_names(hub_cache, monkeypatch, capsys):
    from vllm_rlt.entrypoints.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["generate", "--model", "org/ouro-tasks", "--download-dir", str(hub_cache)]
    argv += ["--trust-remote-code", "--max-model-len", "64", "--generation-config", "vllm"]
    argv += ["--prompt", "347+589=", "--max-tokens", "4", "--temperature", "0", "--json"]
    assert main(argv) == 0
    assert '"text": "936"' in capsys.readouterr().out.replace('":"', '": "')


def _toy_folder(folder, seed: int):
    """A toy checkpoint folder with weights of `seed`."""
    import json

    from safetensors.torch import save_file

    from vllm_rlt.models.toy import toy_config_dict, toy_weights

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(toy_config_dict()))
    save_file(toy_weights(seed), str(folder / "model.safetensors"))
    return folder


def test_load_weights_swaps_the_weights_in_place(tmp_path):
    """After load_weights from a second checkpoint, greedy tokens are that checkpoint's
    (the prefix cache, filled under the old weights, is reset); a bad name or shape is an
    error naming it, with nothing changed."""
    from vllm_rlt.models.toy import toy_weights

    first = str(_toy_folder(tmp_path / "first", 1))
    second = str(_toy_folder(tmp_path / "second", 2))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [[5, 6, 7, 8] * 5]  # a full block or more: prefix-cached after the first run

    def tokens(llm):
        return llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    want = tokens(LLM(model=second))
    llm = LLM(model=first)
    before = tokens(llm)
    assert before != want and llm.engine.kv.num_cached_blocks > 0
    new = toy_weights(2)
    for bad, message in (
        ([("model.layers.0.mlp.nope.weight", new["model.norm.weight"])], "'model.layers.0"),
        ([("model.norm.weight", new["model.embed_tokens.weight"])], "has shape"),
    ):
        with pytest.raises(ValueError, match=message) as caught:
            llm.load_weights([*new.items()][:3] + bad)
        assert caught.value.param == "weights"
        assert tokens(llm) == before  # nothing was copied
    llm.load_weights(new.items())
    assert tokens(llm) == want
    assert llm.reset_prefix_cache() and llm.engine.kv.num_cached_blocks == 0


def _raise(error: BaseException):
    def fail(*args, **kwargs):
        raise error

    return fail


def test_sleep_and_wake_up_keep_outputs_and_give_memory_back(monkeypatch):
    """Level 1: the KV pool and weights release their storage, and after wake_up the
    outputs are the same. Level 2: the weights must come back with load_weights (all of
    them) before anything runs. Requests and sleep refuse each other."""
    from vllm_rlt.models.toy import toy_weights

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10]]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        LLM(model="toy").sleep()
    llm = LLM(model="toy", enable_sleep_mode=True)
    want = tokens(llm)
    kv, embed = llm.engine.runner.k_caches[0], llm.engine.model.embed
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert kv.untyped_storage().nbytes() == 0 and embed.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="the engine is sleeping"):
        llm.generate(prompts, greedy, use_tqdm=False)
    llm.sleep(level=1)  # as wake_up when awake, and as in vLLM: a no-op
    assert llm.is_sleeping() and kv.untyped_storage().nbytes() == 0
    llm.wake_up()
    assert not llm.is_sleeping() and tokens(llm) == want
    # In two steps, as RL frameworks wake: the weights (new ones may load), then the KV pool.
    llm.sleep(level=1)
    with pytest.raises(ValueError, match=r"tags must name some of \['weights', 'kv_cache'\]"):
        llm.wake_up(tags=["optimizer"])
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.load_weights(toy_weights().items())
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and kv.untyped_storage().nbytes() == 0
    assert embed.untyped_storage().nbytes() > 0
    with pytest.raises(ValueError, match=r"the engine is sleeping.*still asleep: kv_cache"):
        llm.generate(prompts, greedy, use_tqdm=False)
    llm.load_weights(toy_weights().items())
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and tokens(llm) == want
    # A wake-up whose device set-up fails (say, out of memory) leaves the engine asleep,
    # and a retry sets it up again.
    llm.sleep(level=1)
    with monkeypatch.context() as patch:
        patch.setattr(ModelRunner, "prepare_device", _raise(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            llm.wake_up()
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping() and tokens(llm) == want
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(ValueError, match="has no weights: load them with load_weights"):
        llm.generate(prompts, greedy, use_tqdm=False)
    weights = list(toy_weights().items())
    with pytest.raises(ValueError, match="needs every tensor of the checkpoint"):
        llm.load_weights(weights[:3])
    llm.load_weights(weights)
    assert tokens(llm) == want
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        llm.sleep(level=3)
    llm.sleep(level=2)
    llm.wake_up()
    llm.sleep(level=1)  # a light sleep does not bring the dropped weights back
    llm.wake_up()
    with pytest.raises(ValueError, match="has no weights"):
        llm.generate(prompts, greedy, use_tqdm=False)
    llm.load_weights(dict(toy_weights()))  # a mapping works as well as pairs
    assert tokens(llm) == want
    assert llm.engine.all_blocks_free() and not llm.engine.has_unfinished


def test_the_built_in_model_sleeps_too():
    """Its weights are loaded from a file: they are the model's own storage all the same."""
    llm = LLM(enable_sleep_mode=True, generation_config=None)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    llm.sleep()
    llm.wake_up()
    assert llm.generate("347+589=", greedy, use_tqdm=False)[0].outputs[0].text == "936"


def test_the_models_generation_eos_ids_hold_without_a_tokenizer(tmp_path):
    """EOS ids that only generation_config.json names end generation with
    skip_tokenizer_init too, as in vLLM."""
    import json
    import shutil

    from vllm_rlt.models.load import DEFAULT_MODEL_DIR

    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 7]}))
    for skip in (False, True):
        llm = LLM(model=str(folder), skip_tokenizer_init=skip)
        assert 7 in llm.engine.eos_token_ids, skip


def test_sleep_thaws_a_frozen_heap_and_wake_up_freezes_it_again():
    """A served process froze its start-up heap: a sleep collects what it lets go of (the
    collector skips frozen objects), and waking up freezes the heap again. A heap nobody
    froze stays unfrozen."""
    import gc

    gc.unfreeze()
    gc.collect()
    nobody = gc.get_freeze_count()  # frozen by the interpreter itself (0 before 3.12)
    llm = LLM(model="toy", enable_sleep_mode=True)
    try:
        gc.freeze()
        llm.sleep(level=1)
        assert gc.get_freeze_count() == nobody
        llm.wake_up()
        assert gc.get_freeze_count() > nobody
    finally:
        gc.unfreeze()
    llm.sleep(level=1)
    llm.wake_up()
    assert gc.get_freeze_count() == nobody
