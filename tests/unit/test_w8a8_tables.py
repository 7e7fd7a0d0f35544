"""Per-GPU tables of W8A8 tiles (ops/w8a8_tables.py): labels, the choice from a probe's
cases, the file format, and every table the package ships."""

from __future__ import annotations

import json

import pytest

from vllm_rlt.kernels.w8a8_tile import W8A8Tile
from vllm_rlt.ops.w8a8_tables import (
    TUNED_DIR,
    best_tiles,
    layer_class,
    parse_label,
    table_file,
    table_from_json,
    table_json,
    tile_label,
)


def test_labels_round_trip():
    tiles = (W8A8Tile(), W8A8Tile(128, 32, 256, 4, 8, 3, promote=True))
    tiles += (W8A8Tile(split_k=2, reduce=True), W8A8Tile(split_k=3, promote=True, reduce=True))
    for tile in tiles:
        assert parse_label(tile_label(tile)) == tile
    assert tile_label(W8A8Tile(64, 32, 128, 2, 4, 6, True)) == "64x32x128x2w4s6p"
    assert tile_label(W8A8Tile(64, 32, 128, 2, 4, 6, True, True)) == "64x32x128x2w4s6pr"
    with pytest.raises(ValueError, match="not a tile label"):
        parse_label("64x64x128")


def _case(rows: int, shape: str, cublas: float, **tiles: float) -> dict:
    case = {"rows": rows, "shape": shape, "bound_us": 1.0, "cublas_us": cublas}
    case.update({label: {"us": us} for label, us in tiles.items()})
    return case


def test_best_tiles_takes_the_fastest_a_promoting_one_within_slack_and_cublas_where_it_wins():
    a, ap, b = "64x64x128x1w4s4", "64x64x128x1w4s4p", "128x64x128x1w4s4"
    cases = [
        _case(256, "o", 9.0, **{a: 6.0, ap: 6.1, b: 7.0}),  # promoted within 3%: taken
        _case(64, "o", 9.0, **{a: 5.0, ap: 6.0, b: 5.5}),  # promoted 20% slower: fastest
        _case(512, "o", 8.0, **{a: 8.5, ap: 8.6, b: 9.0}),  # cuBLAS wins: None
        _case(64, "gate_up", 20.0, **{b: 10.0}),
    ]
    below = {"narrow": ((32, W8A8Tile(split_k=4)), (64, W8A8Tile()), (512, None))}
    table = best_tiles(cases, {"o": "narrow", "gate_up": "wide"}, below)
    assert table == {  # rows under the fewest probed (64) keep `below`'s entries
        "narrow": (
            (32, W8A8Tile(split_k=4)),
            (64, parse_label(a)),
            (256, parse_label(ap)),
            (512, None),
        ),
        "wide": ((64, parse_label(b)),),
    }


def test_table_files_round_trip_and_name_the_device():
    table = {"narrow": ((64, W8A8Tile(split_k=4, promote=True)), (512, None))}
    text = table_json({"device": "NVIDIA H200"}, table)
    data = json.loads(text)
    assert data["device"] == "NVIDIA H200"
    assert table_from_json(data) == table
    assert text.count("\n") < 10  # one line per layer class
    assert table_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_layer_classes():
    assert layer_class(2048, 5632) == "deep"
    assert layer_class(2048, 2048) == "narrow"
    assert layer_class(6144, 2048) == "medium"
    assert layer_class(11264, 2048) == "wide"
    assert layer_class(49152, 2048) == "head"


@pytest.mark.parametrize("path", sorted(TUNED_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_tables_are_well_formed(path):
    """Each shipped table names its GPU model and its probe, its rows rise per class, and
    split-K partials appear only where the add + norms kernel sums the slices (o, down);
    elsewhere a split tile sums its slices itself."""
    data = json.loads(path.read_text())
    assert table_file(data["device"]) == path
    assert data["made_by"].startswith("python -m benchmarks.probe_w8a8_tiles --table")
    for name, entries in table_from_json(data).items():
        assert name in ("narrow", "medium", "wide", "deep")
        rows = [most for most, _ in entries]
        assert rows == sorted(set(rows)) and rows[0] >= 2 and rows[-1] <= 4096
        for _, tile in entries:
            assert tile is None or tile.split_k == 1 or tile.reduce or name in ("narrow", "deep")


def test_the_probe_writes_a_table_from_its_reports(tmp_path, capsys, monkeypatch):
    from benchmarks.probe_w8a8_tiles import main

    report = {
        "device": "NVIDIA H200",
        "versions": "torch x, triton y",
        "cases": [_case(64, "down", 16.0, **{"64x64x128x4w4s4": 7.0})],
    }
    source = tmp_path / "probe_64.json"
    source.write_text(json.dumps(report))
    out = tmp_path / "table.json"
    assert main(["--table", str(source), "--table-out", str(out)]) == 0
    monkeypatch.setenv("VLLM_RLT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["--table", str(source)]) == 0  # by default, into the user's folder
    assert (tmp_path / "cache" / "w8a8_tuned" / "NVIDIA_H200.json").read_text() == out.read_text()
    data = json.loads(out.read_text())
    assert data["device"] == "NVIDIA H200" and data["probed_with"] == ["torch x, triton y"]
    assert table_from_json(data) == {"deep": ((64, parse_label("64x64x128x4w4s4")),)}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**report, "device": "NVIDIA H100 80GB HBM3"}))
    with pytest.raises(SystemExit):
        main(["--table", str(source), str(other), "--table-out", str(out)])
    assert "2 GPU models" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a folder where the file should go
        main(["--table", str(source), "--table-out", str(tmp_path)])
    assert "cannot write" in capsys.readouterr().err


def test_a_card_takes_the_users_table_before_the_packages(tmp_path, monkeypatch):
    """device_table: the user's folder (VLLM_RLT_CACHE_DIR/w8a8_tuned) first, then the
    package's, then none; a broken file is an error naming it."""
    import vllm_rlt.ops.w8a8_tables as tables

    monkeypatch.setenv("VLLM_RLT_CACHE_DIR", str(tmp_path))
    package = tmp_path / "package"
    package.mkdir()
    monkeypatch.setattr(tables, "TUNED_DIR", package)
    monkeypatch.setattr(tables, "table_dirs", lambda: (tmp_path / "w8a8_tuned", package))
    monkeypatch.setattr(tables.torch.cuda, "get_device_name", lambda index: f"GPU {index}")
    shipped = {"narrow": ((64, W8A8Tile()),)}
    own = {"narrow": ((64, W8A8Tile(promote=True)),)}
    table_file("GPU 0", package).write_text(table_json({"device": "GPU 0"}, shipped))
    table_file("GPU 1", package).write_text(table_json({"device": "GPU 1"}, shipped))
    (tmp_path / "w8a8_tuned").mkdir()
    table_file("GPU 1", tmp_path / "w8a8_tuned").write_text(table_json({}, own))
    table_file("GPU 2", package).write_text("{not json")
    tables.device_table.cache_clear()
    try:
        assert tables.device_table(0) == shipped
        assert tables.device_table(1) == own
        assert tables.device_table(3) is None
        with pytest.raises(ValueError, match="GPU_2.json is no table of W8A8 tiles"):
            tables.device_table(2)
    finally:
        tables.device_table.cache_clear()


def test_table_dirs_follow_the_cache_dir(tmp_path, monkeypatch):
    from vllm_rlt.ops.w8a8_tables import table_dirs

    monkeypatch.setenv("VLLM_RLT_CACHE_DIR", str(tmp_path))
    assert table_dirs() == (tmp_path / "w8a8_tuned", TUNED_DIR)


def test_best_tiles_keeps_the_faster_of_a_row_count_probed_twice():
    slow, fast = "64x64x128x1w4s4", "64x32x128x1w4s4"
    cases = [_case(64, "o", 9.0, **{slow: 5.0}), _case(64, "o", 9.0, **{fast: 4.0})]
    assert best_tiles(cases, {"o": "narrow"}, {}) == {"narrow": ((64, parse_label(fast)),)}


def test_a_promoted_tile_that_loses_to_cublas_leaves_the_fastest_tile():
    plain, promoted = "64x64x128x1w4s4", "64x64x128x1w4s4p"
    cases = [_case(64, "o", 5.05, **{plain: 5.0, promoted: 5.1})]
    assert best_tiles(cases, {"o": "narrow"}, {}) == {"narrow": ((64, parse_label(plain)),)}


@pytest.mark.parametrize(
    ("plans", "match"),
    [
        ({"nope": [[64, None]]}, "unknown layer class"),
        ({"narrow": [[64, None], [64, None]]}, "do not rise"),
        ({"narrow": [[128, None], [64, None]]}, "do not rise"),
        ({"narrow": [[0, None]]}, "do not rise"),
        ({"narrow": [[64, "64x64"]]}, "not a tile label"),
    ],
)
def test_malformed_tables_are_refused(plans, match):
    with pytest.raises(ValueError, match=match):
        table_from_json({"plans": plans})


def test_an_empty_table_means_cublas_everywhere(monkeypatch):
    """A card's table with no entries is a table (cuBLAS for every product), not a missing
    one that would fall back to the built-in tiles."""
    import torch

    import vllm_rlt.ops.w8a8_tables as tables

    monkeypatch.setattr(tables, "device_table", lambda index: {})
    assert tables.w8a8_table(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(tables, "device_table", lambda index: None)
    assert tables.w8a8_table(torch.device("cuda", 0)) is tables.W8A8_PLANS
