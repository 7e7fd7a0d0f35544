"""`vllm-rlt generate` takes the model's generation_config.json for every sampling field no
flag sets, as the server does for the fields a request leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_rlt.engine.llm import LLM
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.models.load import DEFAULT_MODEL_DIR


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """The built-in model with a generation_config.json that samples."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in DEFAULT_MODEL_DIR.iterdir():
        if path.name != "generation_config.json":
            (folder / path.name).symlink_to(path)
    config = {"eos_token_id": [2, 0], "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.1}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def used_params(monkeypatch) -> list:
    """The SamplingParams each `LLM.generate` call gets."""
    seen = []
    generate = LLM.generate

    def recording(self, prompts, params=None, **kwargs):
        seen.append(params)
        return generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording)
    return seen


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.1, "top_p": 1.0}),
        (
            ["--temperature", "0", "--top-k", "2", "--top-p", "0.5"],
            {"temperature": 0.0, "top_k": 2, "repetition_penalty": 1.1, "top_p": 0.5},
        ),
    ],
    ids=["model_defaults", "flags_override"],
)
def test_generate_uses_generation_config_unless_a_flag_sets_the_field(
    model_folder, used_params, capsys, flags, expected
):
    argv = ["generate", "--model", str(model_folder), "--prompt", "347+589="]
    assert main([*argv, "--max-tokens", "2", "--no-progress", "--sampling-seed", "1", *flags]) == 0
    (params,) = used_params
    assert {name: getattr(params, name) for name in expected} == expected
    assert params.max_tokens == 2 and params.seed == 1
    assert capsys.readouterr().out.startswith("347+589=")
