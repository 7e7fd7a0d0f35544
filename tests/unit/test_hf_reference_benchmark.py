"""benchmarks/hf_reference.py without the reference's modeling file: the scratch folder it
hands transformers, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.hf_reference import AUTO_MAP, MODELING_FILES, main, reference_folder


def test_the_scratch_folder_links_weights_and_modeling_files_and_maps_the_classes(tmp_path):
    checkpoint, modeling, scratch = (tmp_path / name for name in ("ckpt", "raven", "scratch"))
    for folder in (checkpoint, modeling, scratch):
        folder.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"n_embd": 96}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    for name in MODELING_FILES:  # a Hub folder holds them beside the weights too
        (modeling / name).write_text("# modeling")
        (checkpoint / name).write_text("# the Hub's copy")
    folder = reference_folder(checkpoint, modeling, scratch)
    assert json.loads((folder / "config.json").read_text()) == {"n_embd": 96, "auto_map": AUTO_MAP}
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert all((folder / name).read_text() == "# modeling" for name in MODELING_FILES)
    assert json.loads((checkpoint / "config.json").read_text()) == {"n_embd": 96}  # untouched


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "lacks raven_modeling_minimal.py, raven_config_minimal.py"),
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--output-len", "1"], "--output-len must be >= 2"),
        (["--dtype", "floaty"], "--dtype must name a torch dtype"),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, extra, says):
    (tmp_path / "config.json").write_text("{}")
    modeling = tmp_path / "raven"
    modeling.mkdir()
    if extra:
        for name in MODELING_FILES:
            (modeling / name).write_text("# modeling")
    argv = [str(tmp_path), "--modeling-dir", str(modeling), "--device", "cpu", *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
