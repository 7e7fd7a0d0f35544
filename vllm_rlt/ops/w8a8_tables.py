"""Per-GPU tables of W8A8 tiles: which tile (or cuBLAS) an FP8 tensor-core product of so many
rows takes, per layer class, as benchmarks/probe_w8a8_tiles.py measured them on one GPU
model. The best tile moves between cards of one generation (the H100's choices lost to
bf16 at 256 rows on an H200), so a card with a table of its own (a JSON file in w8a8_tuned/
named after its device name) uses it, and any other card the built-in table
(linear_plans.W8A8_PLANS)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from vllm_rlt.kernels.w8a8_tile import W8A8Tile

# A table: per layer class, (most rows, tile or None for cuBLAS) in increasing rows; a pass
# with more rows than the last entry runs cuBLAS.
Table = dict[str, tuple[tuple[int, W8A8Tile | None], ...]]
TUNED_DIR = Path(__file__).with_name("w8a8_tuned")


def table_file(device_name: str) -> Path:
    """Where the table of a GPU model lives (its device name, non-word runs as '_')."""
    return TUNED_DIR / (re.sub(r"\W+", "_", device_name).strip("_") + ".json")


def table_from_json(data: dict) -> Table:
    """A table from the "plans" of a table file: per class, [most rows, tile label or null]."""
    table = {}
    for name, entries in data["plans"].items():
        parsed = [
            (int(rows), None if label is None else parse_label(label)) for rows, label in entries
        ]
        table[name] = tuple(sorted(parsed, key=lambda entry: entry[0]))
    return table


def table_json(record: dict, table: Table) -> str:
    """A table file's text: `record`'s fields, then "plans" with one line per class."""
    plans = {
        name: [[rows, None if tile is None else tile_label(tile)] for rows, tile in entries]
        for name, entries in table.items()
    }
    lines = [f"  {json.dumps(name)}: {json.dumps(entries)}" for name, entries in plans.items()]
    head = json.dumps(record, indent=2)[:-2]
    return head + ',\n  "plans": {\n  ' + ",\n  ".join(lines) + "\n  }\n}\n"


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
    path = table_file(torch.cuda.get_device_name(device_index))
    if not path.is_file():
        return None
    try:
        return table_from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path} is no table of W8A8 tiles ({exc}); remove it, or remake it with "
            "python -m benchmarks.probe_w8a8_tiles --table"
        ) from exc


def best_tiles(cases: list[dict], classes: dict[str, str], slack: float = 1.03) -> Table:
    """A table from a probe's cases: per class and probed row count, the fastest tile if it
    beats cuBLAS, else None (cuBLAS); a tile that promotes each K chunk into a float32 sum
    is taken when it is within `slack` of the fastest tile. `classes`: shape name -> layer
    class."""
    table: dict[str, list[tuple[int, W8A8Tile | None]]] = {}
    for case in sorted(cases, key=lambda c: c["rows"]):
        timed = [(v["us"], label) for label, v in case.items() if isinstance(v, dict)]
        us, label = min(timed)
        promoted = min((t for t in timed if t[1].endswith("p")), default=None)
        if promoted is not None and promoted[0] <= slack * us:
            us, label = promoted
        tile = parse_label(label) if us < case["cublas_us"] else None
        table.setdefault(classes[case["shape"]], []).append((case["rows"], tile))
    return {name: tuple(entries) for name, entries in table.items()}


def tile_label(tile: W8A8Tile) -> str:
    """A tile's name in probe reports: MxNxKxSPLIT, warps, stages, 'p' if it promotes."""
    label = "x".join(map(str, (tile.block_m, tile.block_n, tile.block_k, tile.split_k)))
    return label + f"w{tile.warps}s{tile.stages}" + ("p" if tile.promote else "")


def parse_label(label: str) -> W8A8Tile:
    """The tile `tile_label` names."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(p?)", label)
    if match is None:
        raise ValueError(f"not a tile label: {label!r}")
    *fields, promote = match.groups()
    return W8A8Tile(*map(int, fields), promote=bool(promote))
