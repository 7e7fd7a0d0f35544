"""CUDA graphs of passes with prompt rows: one upload, two replays, one read-back.

Under steady load nearly every pass carries prompt rows (each admitted request's prompt
runs one loop per pass), and such a pass changes shape every time: how many decode rows,
which chunks at which loops and positions, how many attention tiles. Launched eagerly, its
few hundred kernels bind the host. Here a pass of up to MAX_MIXED_ROWS rows is padded to a
captured size and described entirely by one int64 buffer on the device, filled from the
host in one copy:
- per row: a decode row's slot (the dummy slot elsewhere), a prompt row's table row,
  position, loop, write bound, input token, the row of `out` holding its carried state,
  and whether it is at its chunk's last loop (the model's readout runs for it);
- the prompt rows cut into attention tiles, and the counts [decode rows, tiles], which the
  attention kernels read on the device with a grid bounded by the padded size;
- the prompt rows that sample, and the pass's block-table updates.

Two graphs run it. The stack graph of the padded row count gathers the row inputs, applies
the block updates, builds the metadata and runs one loop of the layer stack with attention
inside, into `out`; for a model that reads out apart, it also decides the decode rows'
exits and runs the readout for them and the prompt rows at their last loop. The head graph
of the padded decode-row count then runs what a decode graph runs after the stack (exits,
sampling, the slot-state scatter, the packed result) on `out`'s decode rows plus the prompt
rows that sample, padded to one of PROMPT_SAMPLER_SIZES (a burst of same-length prompts
finishes together: 64 or more may sample in one pass).

A chunk with loops to go leaves its state in `out`. The next pass reads it there before it
overwrites `out`: a started chunk runs every pass until done, so no other pass comes
between. Padding rows read and write only the dummy block, and their results are dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from vllm_rlt.core.contract import SchedulerOutput
from vllm_rlt.layers.sampler import SamplingMode
from vllm_rlt.models.interface import LoopedModel, StepInputs
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import DeviceCounts, PrefillTiles
from vllm_rlt.sampling_params import MAX_LOGPROBS
from vllm_rlt.worker.cuda_graphs import EAGER_MODES, capture, graph_batch_sizes
from vllm_rlt.worker.exit_sync import SyncedExits
from vllm_rlt.worker.pass_head import PassHead
from vllm_rlt.worker.pass_inputs import (
    KVGeometry,
    PassRows,
    build_metadata,
    decode_row_fields,
    last_loop_rows,
    prefill_tile_fields,
    prompt_row_fields,
    row_seeds,
)
from vllm_rlt.worker.slot_state import SlotState
from vllm_rlt.worker.spec_lanes import SpecLanes

# Passes with more rows run eagerly: their launches are a small part of their device time.
MAX_MIXED_ROWS = 4096
# Prompt rows a captured pass may sample, padded to the first size that holds them: a head
# graph is captured per size, so a pass of few samplers pays for few padding rows.
PROMPT_SAMPLER_SIZES = (32, 256)
# Programs per head of the row attention kernel: each takes every ROW_PROGRAMS-th row.
ROW_PROGRAMS = 128
# Tile programs beyond one per BLOCK_M padded rows (a chunk's last tile may be partial).
EXTRA_TILE_PROGRAMS = 8
# Per-row fields of a prompt row in the input buffer, in order.
ROW_FIELDS = ("table", "position", "loop", "write_hi", "token", "carry", "reads_out")
# Pinned host buffers in turn: one is reused only after later passes were collected.
HOST_BUFFERS = 4

HeadKey = tuple[int, int, SamplingMode, bool, bool, bool]


@dataclass
class Carried:
    """A prompt chunk's state between two of its loops: `hidden` [chunk, hidden], and where
    a captured mixed pass left it in its output buffer (None: an eager pass's tensor)."""

    hidden: torch.Tensor
    out_row: int | None = None


@dataclass(frozen=True)
class PromptPassParts:
    """What the graphs of passes with prompt rows use of the runner, named one by one: the
    model with its caches and kernels, the slot state and its geometry, the pass head, and
    the host side of prompt chunks between their loops."""

    model: LoopedModel
    geo: KVGeometry
    state: SlotState
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    ops: LoopOps
    lanes: SpecLanes | None
    head: PassHead
    dummy_slot: int
    carried: dict[int, Carried]  # slot -> its prompt chunk's state, shared with the runner
    apply_block_updates: Callable[[tuple[tuple[int, int, int], ...]], None]
    keep_carried: Callable[..., list[tuple[int, int]]]


def mixed_sizes(max_rows: int) -> list[int]:
    """Padded row counts for passes of up to `max_rows` rows (capped at MAX_MIXED_ROWS):
    8, then steps of 8 to 64, of 32 to 256, of 128 to 1024, of 512 beyond (a refilled
    wave's prompts arrive together: 64 prompts of 64 tokens are 4096 rows a loop)."""
    cap = min(max_rows, MAX_MIXED_ROWS)
    sizes, size = [], 8
    while size < cap:
        sizes.append(size)
        size += 8 if size < 64 else 32 if size < 256 else 128 if size < 1024 else 512
    sizes.append(cap)
    return sizes


def sampler_sizes(max_num_seqs: int) -> list[int]:
    """The sampler paddings of an engine running up to `max_num_seqs` requests (no pass
    samples more prompts than that)."""
    return sorted({min(size, max_num_seqs) for size in PROMPT_SAMPLER_SIZES})


def buffer_bytes(model: LoopedModel, rows: int) -> int:
    """Device bytes `MixedGraphs` keeps for passes of up to `rows` rows beyond what a pass
    of that size allocates: the carried rows (and the readout rows of a model that reads
    out apart) and the int64 input buffer, and a margin of two carried tensors the stack
    graph holds beside the layer stack (gathered inputs)."""
    size = rows * torch.empty((), dtype=model.dtype).element_size()
    readout = model.config.hidden_size if model.separate_readout else 0
    return size * (3 * model.carried_width + readout) + 8 * (len(ROW_FIELDS) + 9) * rows


class _Layout:
    """The flat int64 input buffer: a fixed part the head graphs read ([decode rows, tiles]
    counts, the prompt samplers' slots and rows, the decode rows' slots), then the part of
    a stack of `rows` rows, laid out for that size, so a pass uploads only its own prefix."""

    def __init__(self, decode_rows: int, samplers: int, rows: int) -> None:
        self.decode_rows, self.samplers, self.rows = decode_rows, samplers, rows
        self.updates = rows + decode_rows  # a block per decode row, a few per prompt chunk
        fixed = 2 + 2 * samplers + decode_rows
        self.base = fixed + fixed % 2  # 16-byte aligned: one Triton variant for every size
        self.total = self.base + (len(ROW_FIELDS) + 5) * rows + 3 * self.updates

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        c, r = self.samplers, self.rows
        views = {
            "counts": flat[:2],
            "p_slots": flat[2 : 2 + c],
            "p_rows": flat[2 + c : 2 + 2 * c],
            "decode_slots": flat[2 + 2 * c : 2 + 2 * c + self.decode_rows],
        }
        start = self.base
        for name in ROW_FIELDS:
            views[name] = flat[start : start + r]
            start += r
        views["tiles"] = flat[start : start + 5 * r].view(5, r)  # never more tiles than rows
        start += 5 * r
        views["block_updates"] = flat[start : start + 3 * self.updates].view(3, self.updates)
        return views


class MixedGraphs:
    """Runs passes with prompt rows as a stack graph and a head graph (module docstring).
    `capture_all` records every stack size and the common head variants up front; heads
    with top logprobs or logit adjustments are captured on first use."""

    def __init__(self, parts: PromptPassParts, pool, sizes: list[int]) -> None:
        self.parts = parts
        self.pool = pool
        self.sizes = sizes
        model, geo, dummy = parts.model, parts.geo, parts.dummy_slot
        largest = sizes[-1]
        # A pass has no more decode rows than rows (takes), nor than slots.
        cap = min(largest, dummy)
        self.head_sizes = [s for s in graph_batch_sizes(dummy) if s < cap] + [cap]
        # A prompt samples once, so no more samplers than requests (not lanes) run.
        requests = parts.lanes.num_seqs if parts.lanes is not None else dummy
        self.sampler_sizes = sampler_sizes(requests)
        self.layouts = {size: _Layout(dummy, self.sampler_sizes[-1], size) for size in sizes}
        # What a row, tile or update holds when nothing is there: the dummy slot, its
        # table row and its block, position 0, loop 0.
        dummy_row = self.dummy_row = geo.final_table_row(dummy)
        self.templates = {}
        for size, layout in self.layouts.items():
            template = torch.zeros(layout.total, dtype=torch.int64)
            fields = layout.views(template)
            for name in ("p_slots", "decode_slots"):
                fields[name].fill_(dummy)
            fields["table"].fill_(dummy_row)
            fields["write_hi"].fill_(1)
            fields["block_updates"][0].fill_(dummy_row)
            fields["block_updates"][2].fill_(geo.num_blocks)
            self.templates[size] = template
        total = self.layouts[largest].total
        pinned = model.device.type == "cuda"
        self.host = [
            torch.zeros(total, dtype=torch.int64, pin_memory=pinned) for _ in range(HOST_BUFFERS)
        ]
        self.next_host = 0
        self.input = self.templates[largest].to(model.device, copy=True)
        self.out = torch.zeros(largest, model.carried_width, dtype=model.dtype, device=model.device)
        # What exiting rows sample from: `out` itself unless the model reads out apart, and
        # then the decode rows' exits and held rows as the stack decided them.
        self.readout = self.out
        if model.separate_readout:
            hidden = model.config.hidden_size
            self.readout = torch.zeros(largest, hidden, dtype=model.dtype, device=model.device)
            self.exits = torch.zeros(2, largest, dtype=torch.bool, device=model.device)
        self.row_index = torch.arange(largest, device=model.device)
        self.tile_rows = parts.ops.prefill_tile_rows(model.dtype)
        self.stacks: dict[int, torch.cuda.CUDAGraph] = {}
        # (decode rows, prompt samplers, sampling mode, with top logprobs, with logit adjustments,
        # with speculation lanes) -> graph, packed output
        self.heads: dict[HeadKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # passes served, for tests

    def takes(self, out: SchedulerOutput) -> bool:
        """Whether this pass fits: prompt rows, at most the largest size, at most the
        largest sampler padding of sampling chunks, and no prompt logprobs (those run
        eagerly)."""
        chunks = out.prefill_chunks
        return (
            bool(chunks)
            and out.num_rows <= self.sizes[-1]
            and sum(c.samples for c in chunks) <= self.sampler_sizes[-1]
            and not any(c.prompt_targets for c in chunks)
        )

    def capture_all(self) -> None:
        """Capture every stack size (largest first, so the smaller ones reuse its memory)
        and the heads of every decode size and sampler padding in the eager sampling modes;
        with speculation, the heads with lanes too."""
        lanes = (False, True) if self.parts.lanes is not None else (False,)
        heads = [
            (size, samplers, mode, False, False, speculating)
            for size in reversed(self.head_sizes)
            for samplers in reversed(self.sampler_sizes)
            for mode in EAGER_MODES
            for speculating in lanes
        ]
        for size in tqdm(
            list(reversed(self.sizes)),
            desc="capturing prompt-pass stacks",
            unit="graph",
            file=sys.stderr,
        ):
            # The capture runs the stack once first: on padding in this size's layout.
            self.input[: self.layouts[size].total].copy_(self.templates[size])
            self.stacks[size] = capture(lambda size=size: self._stack(size), self.pool)[0]
        self.input.copy_(self.templates[self.sizes[-1]])
        for key in tqdm(heads, desc="capturing prompt-pass heads", unit="graph", file=sys.stderr):
            self._capture_head(key)

    def _capture_head(self, key: HeadKey) -> None:
        self.heads[key] = capture(lambda: self._head(*key), self.pool)

    def _stack(self, size: int) -> None:
        """Row inputs, block updates, metadata and one loop of the stack, into `out`."""
        parts, f = self.parts, self.layouts[size].views(self.input)
        st, geo, model = parts.state, parts.geo, parts.model
        updates = f["block_updates"]
        st.block_table[updates[0], updates[1]] = updates[2]
        index = self.row_index[:size]
        is_decode = index < f["counts"][0]
        decode_slots = f["decode_slots"]
        slots = torch.where(
            is_decode, decode_slots[index.clamp(max=decode_slots.shape[0] - 1)], parts.dummy_slot
        )
        decode = decode_row_fields(slots, st, geo, parts.lanes)
        rows = PassRows(
            tables=torch.where(is_decode, decode.tables, f["table"]),
            positions=torch.where(is_decode, decode.positions, f["position"]),
            loops=torch.where(is_decode, decode.loops, f["loop"]),
            write_hi=torch.where(is_decode, decode.write_hi, f["write_hi"]),
        )
        tokens = torch.where(is_decode, st.token[slots], f["token"])
        carried = torch.where(is_decode.unsqueeze(1), st.hidden[slots], self.out[f["carry"]])
        seeds = row_seeds(st, rows, geo, model.draws_initial_state)
        padding = None  # the rows past the pass's own: prompt rows left as the template
        if model.separate_readout:
            padding = ~is_decode & (f["table"] == self.dummy_row)
        meta = build_metadata(rows, (), st, geo, 0, with_segments=False)
        meta.rows_independent = False  # its prompt rows read what other rows write
        meta.prefill_tiles = PrefillTiles(f["tiles"])
        meta.device_counts = DeviceCounts(
            f["counts"],
            row_programs=min(size, ROW_PROGRAMS),
            tile_programs=-(-size // self.tile_rows) + EXTRA_TILE_PROGRAMS,
        )
        state = model.step(
            StepInputs(tokens, carried, rows.loops, seeds, padding),
            meta,
            parts.k_caches,
            parts.v_caches,
            parts.ops,
        )
        sync = parts.head.sync
        if sync is not None:  # held rows keep what they carried in
            state = sync.frozen(state, slots)
        self.out[:size].copy_(state)
        if model.separate_readout:
            # One stack graph serves passes with and without lanes: without them no lane
            # row is held or drafted, and the drafting flag the last speculating pass
            # uploaded was 0, so the lanes' events are the policy's exits.
            head = parts.head
            live, decided, carried = head.readout_rows(state, slots, rows.loops, parts.lanes)
            live = torch.where(is_decode, live, f["reads_out"] != 0)
            if parts.lanes is not None:  # a held lane reads out from the state it kept
                state = torch.where(is_decode.unsqueeze(1), carried, state)
            readout = model.readout(state, live, meta, parts.k_caches, parts.v_caches, parts.ops)
            self.readout[:size].copy_(readout)
            if decided is not None:
                self.exits[0, :size].copy_(decided.exit)
                if decided.held_back is not None:
                    self.exits[1, :size].copy_(decided.held_back)

    def _head(
        self,
        size: int,
        samplers: int,
        mode: SamplingMode,
        with_top: bool,
        adjusted: bool,
        speculating: bool,
    ):
        """What follows the stack for `size` decode rows and `samplers` prompt samplers."""
        f = self.layouts[self.sizes[-1]].views(self.input)  # the fixed part: any size's
        return self.parts.head.run(
            self.out[:size],
            self.readout[:size],
            f["decode_slots"][:size],
            self.readout[f["p_rows"][:samplers]],
            f["p_slots"][:samplers],
            mode,
            MAX_LOGPROBS if with_top else 0,
            adjusted,
            speculating,
            decided=self._decided(size),
        )

    def _decided(self, size: int) -> SyncedExits | None:
        """The exits of `size` decode rows as the stack graph decided them, where it does
        (see `_stack`)."""
        parts = self.parts
        if not parts.model.separate_readout or parts.head.exit_policy.needs_logits:
            return None
        held_back = self.exits[1, :size] if parts.head.sync is not None else None
        return SyncedExits(self.exits[0, :size], held_back)

    def run(
        self,
        out: SchedulerOutput,
        mode: SamplingMode,
        num_top: int,
        adjusted: bool,
        speculating: bool,
    ) -> tuple[torch.Tensor, list[int]]:
        """Enqueue the pass; returns the packed results and the slot of each packed row
        (the dummy slot for padding rows)."""
        parts = self.parts
        chunks, decode_slots = out.prefill_chunks, out.decode_slots
        num_decode, num_rows = len(decode_slots), out.num_rows
        size = next(s for s in self.sizes if s >= num_rows)
        head_size = next(s for s in self.head_sizes if s >= max(num_decode, 1))
        layout = self.layouts[size]
        host = self.host[self.next_host][: layout.total]
        self.next_host = (self.next_host + 1) % len(self.host)
        host.copy_(self.templates[size])
        f = layout.views(host)
        if num_decode:
            f["decode_slots"][:num_decode] = torch.tensor(decode_slots, dtype=torch.int64)
        for name, values in zip(
            ("table", "position", "loop", "write_hi"),
            prompt_row_fields(chunks, parts.geo),
            strict=True,
        ):
            f[name][num_decode:num_rows] = values
        tokens, carry = self._inputs(chunks)
        f["token"][num_decode:num_rows] = torch.tensor(tokens, dtype=torch.int64)
        f["carry"][num_decode:num_rows] = torch.tensor(carry, dtype=torch.int64)
        f["reads_out"][num_decode:num_rows] = last_loop_rows(chunks, parts.model.config.num_loops)
        tiles = prefill_tile_fields(chunks, num_decode, parts.geo, self.tile_rows)
        f["tiles"][:, : tiles.shape[1]] = tiles
        f["counts"][0], f["counts"][1] = num_decode, tiles.shape[1]
        updates = out.block_updates
        if len(updates) <= layout.updates:
            if updates:
                f["block_updates"][:, : len(updates)] = torch.tensor(updates, dtype=torch.int64).T
        else:
            parts.apply_block_updates(updates)
        samplers = parts.keep_carried(self.out, chunks, num_decode, in_buffer=True)
        for i, (slot, row) in enumerate(samplers):
            f["p_slots"][i], f["p_rows"][i] = slot, row
        sampler_size = next(s for s in self.sampler_sizes if s >= len(samplers))
        key = (head_size, sampler_size, mode, num_top > 0, adjusted, speculating)
        if key not in self.heads:
            # The capture runs the head once first: on padding rows only, not this pass's.
            self.input.copy_(self.templates[self.sizes[-1]])
            self._capture_head(key)
        self.input[: layout.total].copy_(host, non_blocking=True)
        self.stacks[size].replay()
        graph, packed = self.heads[key]
        graph.replay()
        self.num_replays += 1
        dummy = parts.dummy_slot
        slots = list(decode_slots) + [dummy] * (head_size - num_decode)
        slots += [slot for slot, _ in samplers] + [dummy] * (sampler_size - len(samplers))
        return packed, slots

    def _inputs(self, chunks) -> tuple[list[int], list[int]]:
        """Per prompt row: its input token and the row of `out` holding its state (later
        loops). State an eager pass left is staged into `out` first, past the rows a
        captured pass left there."""
        held = self.parts.carried
        carried = {c.slot: held.pop(c.slot) for c in chunks if c.loop > 0}
        free_row = max(
            (c.out_row + c.hidden.shape[0] for c in carried.values() if c.out_row is not None),
            default=0,
        )
        tokens: list[int] = []
        carry: list[int] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            tokens += chunk.token_ids
            if chunk.loop == 0:
                carry += [0] * n
                continue
            state = carried[chunk.slot]
            row = state.out_row
            if row is None:
                row, free_row = free_row, free_row + n
                self.out[row : row + n].copy_(state.hidden)
            carry += range(row, row + n)
        return tokens, carry
