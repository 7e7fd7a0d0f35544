"""Per-GPU tables of W8A8 tiles: which tile (or cuBLAS) an FP8 tensor-core product of so many
rows takes, per layer class, as benchmarks/probe_w8a8_tiles.py measured them on one GPU
model. The best tile moves between cards of one generation (the H100's choices lost to
bf16 at 256 rows on an H200), so a card with a table of its own (a JSON file named after its
device name, in the user's folder, cache_root()/w8a8_tuned/, where the probe writes it, or
shipped in the package's w8a8_tuned/) uses it, and any other card the built-in W8A8_PLANS."""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

import torch

from vllm_rlt.config import cache_root
from vllm_rlt.kernels.w8a8_tile import W8A8Tile

logger = logging.getLogger(__name__)

# A table: per layer class, (most rows, tile or None for cuBLAS) in increasing rows; a pass
# with more rows than the last entry runs cuBLAS.
Table = dict[str, tuple[tuple[int, W8A8Tile | None], ...]]
TUNED_DIR = Path(__file__).with_name("w8a8_tuned")

# The built-in table, for GPU models without one of their own. Passes above
# linear_plans.FP8_SKINNY_ROWS rows run FP8 weights' products on these W8A8 tiles, per layer
# class, up to so many rows, and on cuBLAS's FP8 product past the last entry (or where an
# entry's tile is None). Measured per projection with benchmarks/probe_w8a8_tiles.py on an
# H100 at Ouro-1.4B shapes, 24 layers' weights from HBM, float8 rows as the norms hand them
# on (docs/benchmarks/2026-12-05-w8a8-tiles/probe.json), microseconds against cuBLAS's: at
# 64 rows qkv 7.7 / 9.6, o 4.6 / 8.7 (split-K 4), gate_up 11.0 / 13.6, down 7.6 / 16.5
# (split-K 4); at 256 rows o 6.1 / 8.7 and down 11.2 / 16.8, while qkv and gate_up tie or
# lose from 128 rows; at 512 only o and down still gain (7.6 / 8.8, 15.6 / 16.6). Split-K
# (o, down) only where the residual add + norms kernel sums the slices; elsewhere the same
# tile runs with one slice.
W8A8_PLANS: Table = {
    "narrow": (
        (64, W8A8Tile(64, 64, 128, split_k=4)),
        (128, W8A8Tile(64, 32, 128, split_k=2)),
        (256, W8A8Tile(64, 64, 128, stages=6)),
        (512, W8A8Tile(128, 64, 128)),
    ),
    "medium": ((128, W8A8Tile(64, 64, 128, stages=6)),),
    "wide": ((64, W8A8Tile(64, 32, 256, stages=3)),),
    "deep": (
        (128, W8A8Tile(64, 64, 128, split_k=4)),
        (256, W8A8Tile(64, 64, 128, stages=6)),
        (512, W8A8Tile(128, 64, 128)),
    ),
}


def table_dirs() -> tuple[Path, Path]:
    """Where tables are looked for, the first holding a card's file winning: the user's
    folder (what the probe writes), then the package's."""
    return cache_root() / "w8a8_tuned", TUNED_DIR


def table_file(device_name: str, folder: Path = TUNED_DIR) -> Path:
    """The file of a GPU model's table in `folder` (its device name, non-word runs as '_')."""
    return folder / (re.sub(r"\W+", "_", device_name).strip("_") + ".json")


def table_from_json(data: dict) -> Table:
    """A table from the "plans" of a table file: per class, [most rows, tile label or null]
    with the rows rising. ValueError (or KeyError, TypeError) for anything else."""
    table = {}
    for name, entries in data["plans"].items():
        if name not in CLASSES:
            raise ValueError(f"unknown layer class {name!r} (one of {', '.join(CLASSES)})")
        parsed = [
            (int(most), None if label is None else parse_label(label)) for most, label in entries
        ]
        rows = [most for most, _ in parsed]
        if rows != sorted(set(rows)) or (rows and rows[0] < 1):
            raise ValueError(f"{name}: the row counts {rows} do not rise from 1 or more")
        table[name] = tuple(parsed)
    return table


def table_json(record: dict, table: Table) -> str:
    """A table file's text: `record`'s fields, then "plans", a line each."""
    fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in record.items()]
    plans = [
        f"    {json.dumps(name)}: "
        + json.dumps([[rows, None if tile is None else tile_label(tile)] for rows, tile in entries])
        for name, entries in table.items()
    ]
    fields.append('  "plans": {\n' + ",\n".join(plans) + "\n  }")
    return "{\n" + ",\n".join(fields) + "\n}\n"


CLASSES = ("narrow", "medium", "wide", "head", "deep")


def layer_class(n: int, k: int) -> str:
    """The layer class of a weight of N outputs and K inputs: its row of
    linear_plans.LINEAR_PLANS and its key in a W8A8 table."""
    if n < k:
        return "deep"
    if n <= 4096:
        return "narrow"
    if n <= 8192:
        return "medium"
    return "wide" if n <= 16384 else "head"


@functools.cache
def device_table(device_index: int) -> Table | None:
    """The table measured on the GPU model of CUDA device `device_index`, or None."""
    name = torch.cuda.get_device_name(device_index)
    path = next((p for p in (table_file(name, d) for d in table_dirs()) if p.is_file()), None)
    if path is None:
        return None
    try:
        table = table_from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is no table of W8A8 tiles ({exc}); remove it, or remake it with "
            "python -m benchmarks.probe_w8a8_tiles --table"
        ) from exc
    logger.info("W8A8 tiles for %s: the table in %s", name, path)
    return table


def best_tiles(
    cases: list[dict], classes: dict[str, str], below: Table, slack: float = 1.03
) -> Table:
    """A table from a probe's cases: per class and probed row count, the fastest tile if it
    beats cuBLAS, else None (cuBLAS); a tile that promotes each K chunk into a float32 sum
    is taken instead where it is within `slack` of the fastest and beats cuBLAS too. A row
    count probed twice keeps its faster case. Passes with fewer rows than the fewest probed
    keep `below`'s entries (the probe says nothing about them). `classes`: shape name ->
    layer class. KeyError or ValueError for a case that lacks what a probe writes."""
    chosen: dict[tuple[str, int], tuple[float, W8A8Tile | None]] = {}
    for case in cases:
        timed = [(v["us"], label) for label, v in case.items() if isinstance(v, dict)]
        cublas = float(case["cublas_us"])
        us, label = min(timed) if timed else (cublas, None)
        promoted = min((t for t in timed if parse_label(t[1]).promote), default=None)
        if promoted is not None and promoted[0] <= slack * us and promoted[0] < cublas:
            us, label = promoted
        pick = (us, parse_label(label)) if label is not None and us < cublas else (cublas, None)
        key = (classes[case["shape"]], int(case["rows"]))
        if key not in chosen or pick[0] < chosen[key][0]:
            chosen[key] = pick
    if not chosen:
        raise ValueError("no cases")
    fewest = min(rows for _, rows in chosen)
    table: dict[str, list[tuple[int, W8A8Tile | None]]] = {}
    for (name, rows), (_, tile) in sorted(chosen.items(), key=lambda item: item[0][1]):
        if name not in table:
            table[name] = [entry for entry in below.get(name, ()) if entry[0] < fewest]
        table[name].append((rows, tile))
    return {name: tuple(entries) for name, entries in table.items()}


def tile_label(tile: W8A8Tile) -> str:
    """A tile's name in probe reports: MxNxKxSPLIT, warps, stages, then 'p' if it promotes
    and 'r' if it sums its K slices itself."""
    label = "x".join(map(str, (tile.block_m, tile.block_n, tile.block_k, tile.split_k)))
    label += f"w{tile.warps}s{tile.stages}"
    return label + ("p" if tile.promote else "") + ("r" if tile.reduce else "")


def parse_label(label: str) -> W8A8Tile:
    """The tile `tile_label` names."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(p?)(r?)", label)
    if match is None:
        raise ValueError(f"not a tile label: {label!r}")
    *fields, promote, reduce = match.groups()
    return W8A8Tile(*map(int, fields), promote=bool(promote), reduce=bool(reduce))


def w8a8_table(device: torch.device) -> Table:
    """The W8A8 tiles of `device`'s GPU model where it has a table, else W8A8_PLANS."""
    table = device_table(device.index)
    return W8A8_PLANS if table is None else table
