"""ModelRunner: turns a SchedulerOutput into one pass over the shared layer stack."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_rlt.core.contract import (
    ModelRunnerOutput,
    NewSlot,
    PrefillChunk,
    SchedulerOutput,
)
from vllm_rlt.exit.policy import ExitPolicy
from vllm_rlt.layers.sampler import SamplingMode
from vllm_rlt.models.interface import LoopedModel, StepInputs
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import AttentionMetadata
from vllm_rlt.worker.cuda_graphs import DecodeGraphs
from vllm_rlt.worker.exit_sync import ExitSync, SyncedExits
from vllm_rlt.worker.host_uploads import HostUploads
from vllm_rlt.worker.kv_pool import KVPool, KVSource
from vllm_rlt.worker.mixed_graphs import Carried, MixedGraphs, PromptPassParts, mixed_sizes
from vllm_rlt.worker.pass_head import PassHead
from vllm_rlt.worker.pass_inputs import (
    KVGeometry,
    PassRows,
    build_metadata,
    gather_rows,
    last_loop_rows,
    row_seeds,
)
from vllm_rlt.worker.prompt_logprobs import PromptRows, prompt_logprobs, prompt_rows
from vllm_rlt.worker.slot_state import SlotState
from vllm_rlt.worker.spec_lanes import SpecLanes


@dataclass
class PendingPass:
    """A launched pass: its results arrive in `packed` once `done` has fired."""

    samplers: list[int]  # slot of each packed row
    packed: torch.Tensor  # [samplers, PACKED_FIELDS + 2 * top] float32, on the host when CUDA
    done: torch.cuda.Event | None
    prompt: list[PromptRows]  # on the host when CUDA


class ModelRunner:
    """Owns the model, the KV cache, per-slot device state, and executes passes.

    One pass: gather row inputs (embedding for loop-0 rows, carried state otherwise), run
    one loop of the layer stack, decide exits and sample on the device, scatter state back,
    and read the results back to the host once. A pass without prefill rows touches no host
    data at all, so it can be captured as a CUDA graph (`graphs`).
    """

    def __init__(
        self,
        model: LoopedModel,
        geometry: KVGeometry,
        max_slots: int,
        max_model_len: int,
        exit_policy: ExitPolicy,
        ops: LoopOps,
        lanes: SpecLanes | None = None,
        kv_dtype: torch.dtype | None = None,  # the K/V pool's (None: the model's dtype)
        exit_sync_passes: int = 1,  # ExitConfig.sync_passes (1: exits are not held)
    ) -> None:
        cfg = model.config
        self.model = model
        self.geo = geometry
        self.exit_policy = exit_policy
        self.ops = ops
        self.num_loops = cfg.num_loops
        self.max_model_len = max_model_len
        # Zeroed, not empty: masked keys must still hold finite values.
        self.k_caches = [
            torch.zeros(
                (planes * geometry.slots_per_plane, cfg.num_key_value_heads, cfg.head_dim),
                dtype=kv_dtype or model.dtype,
                device=model.device,
            )
            for planes in cfg.kv_planes(geometry.planes)
        ]  # per attention layer [its planes * slots_per_plane, kv_heads, head_dim]
        self.v_caches = [torch.zeros_like(k) for k in self.k_caches]
        self.state = SlotState(
            max_slots,
            model.carried_width,
            cfg.vocab_size,
            -(-max_model_len // geometry.block_size),
            geometry.num_blocks,
            model.dtype,
            model.device,
            geometry.table_planes,
            exit_sync=exit_sync_passes > 1,
        )
        self.dummy_slot = max_slots
        self.prefill_hidden: dict[int, Carried] = {}  # slot -> its prompt chunk's state
        # Self-speculation: `max_slots` counts every lane (see worker/spec_lanes.py)
        self.lanes = lanes
        # After the layer stack: one pipeline for eager passes and every graph. It holds the
        # state, lanes and exit policy: whatever replaces one of them must rebuild it.
        sync = None
        if exit_sync_passes > 1:
            sync = ExitSync(exit_sync_passes, self.state, self.dummy_slot)
        self.head = PassHead(
            model, ops, self.state, geometry, exit_policy, lanes, self.dummy_slot, sync
        )
        self.graphs: DecodeGraphs | None = None  # captured by `prepare_device`
        self.mixed: MixedGraphs | None = None  # likewise: the passes with prompt rows
        # Passes that replayed decode graphs and prompt-pass graphs (the rest ran eagerly).
        self.num_decode_graph_passes = self.num_prompt_graph_passes = 0
        self.uploads = HostUploads(max_slots + 1, model.device)

    def prepare_device(self, cuda_graphs: bool, max_num_batched_tokens: int) -> None:
        """On CUDA: capture the decode graphs and the graphs of passes with prompt rows (when
        `cuda_graphs` and the attention backend allow), then warm up the passes with prompt
        rows that run eagerly. Elsewhere: nothing. A failed set-up leaves no graphs, so a
        retry captures them again from scratch."""
        if self.model.device.type != "cuda":
            return
        try:
            if cuda_graphs and not self.ops.needs_segments:
                self.capture_graphs(max_num_batched_tokens)
            self.warm_up_prompt_passes(sorted({1, max_num_batched_tokens}))
        except BaseException:
            self.drop_graphs()
            raise

    def capture_graphs(self, max_num_batched_tokens: int) -> None:
        """Capture the decode graphs, then, in their memory pool, the graphs of passes with
        prompt rows of up to `max_num_batched_tokens` rows."""
        self.graphs = DecodeGraphs(
            self.decode_pass,
            self.dummy_slot,
            self.uploads.upload,
            self.model.device,
            with_lanes=self.lanes is not None,
        )
        self.graphs.capture_all()
        self.mixed = MixedGraphs(
            self.prompt_pass_parts(), self.graphs.pool, mixed_sizes(max_num_batched_tokens)
        )
        self.mixed.capture_all()

    def drop_graphs(self) -> None:
        """Forget the captured graphs: they hold device addresses, so they go before the
        memory they read is released; passes run eagerly until `prepare_device` again."""
        self.graphs = self.mixed = None

    @contextlib.contextmanager
    def eager_passes(self) -> Iterator[None]:
        """Within: every pass runs eagerly, the captured graphs kept for after (to time a
        pass against its graphed form)."""
        graphs, mixed = self.graphs, self.mixed
        self.drop_graphs()
        try:
            yield
        finally:
            self.graphs, self.mixed = graphs, mixed

    def prompt_pass_parts(self) -> PromptPassParts:
        return PromptPassParts(
            self.model,
            self.geo,
            self.state,
            self.k_caches,
            self.v_caches,
            self.ops,
            self.lanes,
            self.head,
            self.dummy_slot,
            self.prefill_hidden,
            self.apply_block_updates,
            self.keep_carried,
        )

    def decode_pass(
        self,
        slots: torch.Tensor,
        mode: SamplingMode,
        num_top: int,
        adjusted: bool,
        speculating: bool,
    ) -> torch.Tensor:
        """The packed results of a decode-only pass over `slots` (a device tensor): what the
        decode graphs capture."""
        return self.run_pass(slots, (), 0, mode, num_top, adjusted, speculating)[0]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Admit the pass's new requests, run it and wait for its results."""
        for _, error in self.admit(out.new_slots):
            raise error
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def admit(self, news: Sequence[NewSlot]) -> list[tuple[NewSlot, Exception]]:
        """Write the slots of newly admitted requests; returns those whose admission failed
        (with the error). A failed request is failed after the pass is queued: its rows
        there write only its own blocks, which nobody reads before they are written again
        (they are freed after that pass, in stream order)."""
        lanes = self.lanes
        rows = list(news)  # every speculation lane samples with its request's settings
        if lanes is not None:
            rows += [
                replace(new, slot=lane)
                for new in news
                if new.speculates
                for lane in lanes.lane_slots(new.slot)[1:]
            ]
        try:
            slots = self.state.admit(rows, self.uploads.upload)
            if slots is not None:
                self.exit_policy.admit(rows, slots, self.uploads.upload)
        except Exception as error:  # noqa: BLE001 - the requests of this admission fail
            for new in news:
                self.state.clear_tables(new.slot)
            return [(new, error) for new in news]
        failed = []
        for new in news:
            try:
                self.state.admit_extras(new)
                if new.imported_kv is not None:
                    self.import_kv(new.imported_kv, new.imported_blocks, new.imported_from)
                if lanes is not None:
                    lanes.admit(new.slot, new.speculates, new.prompt_len, new.last_position)
                    if new.speculates:
                        for lane in lanes.lane_slots(new.slot)[1:]:
                            self.state.admit_extras(replace(new, slot=lane))
            except Exception as error:  # noqa: BLE001 - fails this request only
                self.state.clear_tables(new.slot)
                failed.append((new, error))
            self.prefill_hidden.pop(new.slot, None)
        return failed

    @property
    def kv_pool(self) -> KVPool:
        return KVPool(self.k_caches, self.v_caches, self.geo.planes, self.geo.block_size)

    @property
    def kv_position_bytes(self) -> int:
        """K/V bytes one position takes in this pool, over every layer and plane."""
        return sum(
            2 * cache[0].numel() * cache.element_size() * cache.shape[0] // self.geo.slots_per_plane
            for cache in self.k_caches
        )

    @torch.inference_mode()
    def import_kv(self, source: KVSource, blocks: Sequence[int], start: int = 0) -> None:
        """Copy a handed-over completion's K/V of positions from `start` on (those before
        are in this pool's prefix cache) from its prefill core's pool into `blocks`, in
        stream order before any pass that reads them (a peer out of stream has read them on
        return)."""
        pool, ours = source.pool, self.kv_pool
        if pool.geometry != ours.geometry:
            raise ValueError(
                f"handed-over K/V has (layers, planes, kv_heads, head_dim, dtype) "
                f"{pool.geometry}, expected {ours.geometry}"
            )
        pool.read_into(source.blocks, list(blocks), start)

    def copies_done(self) -> Any:
        """What says the copies queued so far are done: a CUDA event (None on the CPU,
        whose copies are done on return)."""
        if self.model.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingPass:
        """Enqueue one pass and the copy of its results to the host; does not wait for it.
        Its new slots must have been admitted (`admit`) first."""
        st = self.state
        samplers = list(out.decode_slots) + [c.slot for c in out.prefill_chunks if c.samples]
        num_top = max((st.num_logprobs[s] for s in samplers), default=0)
        mode = max((st.sampling_mode[s] for s in samplers), default=SamplingMode.GREEDY)
        adjusted = any(st.adjusted[s] for s in samplers)
        speculating = self.lanes is not None and out.speculating
        if speculating:
            self.uploads.upload([int(out.drafting)], out=self.lanes.drafting)
        prompt: list[PromptRows] = []
        if self.mixed is not None and self.mixed.takes(out):
            packed, samplers = self.mixed.run(out, mode, num_top, adjusted, speculating)
            self.num_prompt_graph_passes += 1
        elif self.graphs is not None and not out.prefill_chunks:
            self.apply_block_updates(out.block_updates)
            packed = self.graphs.replay(out.decode_slots, mode, num_top, adjusted, speculating)
            self.num_decode_graph_passes += 1
        else:
            self.apply_block_updates(out.block_updates)
            decode = self.uploads.upload(out.decode_slots)
            packed, prompt = self.run_pass(
                decode, out.prefill_chunks, out.max_context, mode, num_top, adjusted, speculating
            )
        if packed.is_cuda:
            host = packed.to("cpu", non_blocking=True)  # pinned, so it overlaps
            for rows in prompt:
                rows.values = rows.values.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return PendingPass(samplers, host, done, prompt)
        return PendingPass(samplers, packed, None, prompt)

    @torch.inference_mode()
    def warm_up_prompt_passes(self, row_counts: list[int]) -> None:
        """Run one pass with prompt rows per row count, on the dummy slot, before any
        request: the first such pass compiles the prompt attention kernel and sets up the
        large GEMMs, which would otherwise land in the first requests' latency (about a
        second on a fresh machine). The dummy slot's table addresses only the dummy block,
        and its state is reset after every pass, so nothing real is read or written."""
        no_decode = torch.empty(0, dtype=torch.int64, device=self.model.device)
        for rows in row_counts:
            lengths = [self.max_model_len] * (rows // self.max_model_len)
            if rows % self.max_model_len:
                lengths.append(rows % self.max_model_len)
            chunks = tuple(
                PrefillChunk(self.dummy_slot, "", 0, (0,) * n, 0, samples=i == len(lengths) - 1)
                for i, n in enumerate(lengths)
            )
            self.run_pass(no_decode, chunks, max(lengths), SamplingMode.GREEDY, num_top=0)
            self.prefill_hidden.pop(self.dummy_slot, None)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    @torch.inference_mode()
    def apply_block_updates(self, updates: tuple[tuple[int, int, int], ...]) -> None:
        """Write the blocks a schedule took into the device tables (in stream order): one
        upload and one scatter of every (table row, index, block)."""
        if updates:
            flat = self.uploads.upload([v for update in updates for v in update])
            table_rows, indices, blocks = flat.view(-1, 3).unbind(1)
            self.state.block_table[table_rows, indices] = blocks

    def collect(self, pending: PendingPass) -> ModelRunnerOutput:
        """Wait for a launched pass (the one host sync of a pass) and decode its results."""
        if pending.done is not None:
            pending.done.synchronize()
        output = self.head.results(pending.packed.tolist(), pending.samplers)
        if not pending.prompt:
            return output
        prompt = tuple(prompt_logprobs(rows) for rows in pending.prompt)
        return ModelRunnerOutput(output.sampled, output.decode_slots_continuing, prompt)

    def run_pass(
        self,
        decode: torch.Tensor,  # [decode rows] slots
        chunks: tuple[PrefillChunk, ...],
        max_context: int,
        mode: SamplingMode,
        num_top: int,
        adjusted: bool = False,
        speculating: bool = False,
    ) -> tuple[torch.Tensor, list[PromptRows]]:
        """One pass on the device; returns [samplers, PACKED_FIELDS + 2 * num_top] float32
        and the prompt logprobs of the chunks that ask for them. `adjusted`: some sampling
        row's request has logit_bias or penalties. `speculating`: some decode rows are
        speculation lanes."""
        st, model = self.state, self.model
        lanes = self.lanes if speculating else None
        rows = gather_rows(decode, chunks, st, self.geo, lanes, self.uploads.upload)
        num_decode = decode.shape[0]
        d_loops = rows.loops[:num_decode]
        meta = build_metadata(
            rows,
            chunks,
            st,
            self.geo,
            max_context,
            self.ops.needs_segments,
            self.ops.prefill_tile_rows(model.dtype),
            self.uploads.upload,
            lanes,
        )
        state = model.step(
            self._step_inputs(decode, chunks, rows), meta, self.k_caches, self.v_caches, self.ops
        )
        sync = self.head.sync
        if sync is not None:  # held rows keep what they carried in
            state = torch.cat([sync.frozen(state[:num_decode], decode), state[num_decode:]])
        readout, decided = self._readout(state, decode, d_loops, chunks, meta, lanes)
        prompt = prompt_rows(self.model, self.ops, readout, chunks, num_decode)
        samplers = self.keep_carried(state, chunks, num_decode)
        p_slots = p_rows = decode[:0]
        if samplers:
            p_slots, p_rows = self.uploads.upload(
                [s for s, _ in samplers] + [r for _, r in samplers]
            ).view(2, -1)
        packed = self.head.run(
            state[:num_decode],
            readout[:num_decode],
            decode,
            readout[p_rows],
            p_slots,
            mode,
            num_top,
            adjusted,
            speculating,
            d_loops,
            decided,
        )
        return packed, prompt

    def _readout(
        self,
        state: torch.Tensor,
        decode: torch.Tensor,
        d_loops: torch.Tensor,
        chunks: tuple[PrefillChunk, ...],
        meta: AttentionMetadata,
        lanes: SpecLanes | None,
    ) -> tuple[torch.Tensor, SyncedExits | None]:
        """(what each row samples from if it exits now [rows, hidden], the decode rows'
        exits when decided first): a model that reads out apart runs its readout for the
        decode rows that exit or draft and the prompt rows at their last loop only."""
        if not self.model.separate_readout:
            return state, None
        num_decode = decode.shape[0]
        live, decided, carried = self.head.readout_rows(state[:num_decode], decode, d_loops, lanes)
        if lanes is not None:  # a held lane reads out from the state it kept
            state = torch.cat([carried, state[num_decode:]])
        if chunks:
            prompt_live = self.uploads.upload(last_loop_rows(chunks, self.num_loops)) != 0
            live = torch.cat([live, prompt_live])
        readout = self.model.readout(state, live, meta, self.k_caches, self.v_caches, self.ops)
        return readout, decided

    def _step_inputs(
        self, decode: torch.Tensor, chunks: tuple[PrefillChunk, ...], rows: PassRows
    ) -> StepInputs:
        """Each row's token and carried state: a decode row's from its slot, a prompt
        chunk's tokens in one upload and its state from its previous loop (zeros at loop
        0, where the model does not read it)."""
        st, model = self.state, self.model
        tokens, carried = [st.token[decode]], [st.hidden[decode]]
        if chunks:
            tokens.append(self.uploads.upload([t for chunk in chunks for t in chunk.token_ids]))
        for chunk in chunks:
            if chunk.loop == 0:
                carried.append(st.hidden.new_zeros(len(chunk.token_ids), st.hidden.shape[1]))
            else:
                carried.append(self.prefill_hidden.pop(chunk.slot).hidden)
        padding = None  # a decode graph's padding rows, for a model with stages to skip
        if model.separate_readout:
            prompt = rows.loops.shape[0] - decode.shape[0]
            padding = torch.cat([decode == self.dummy_slot, decode.new_zeros(prompt, dtype=bool)])
        return StepInputs(
            torch.cat(tokens) if chunks else tokens[0],
            torch.cat(carried) if chunks else carried[0],
            rows.loops,
            row_seeds(st, rows, self.geo, model.draws_initial_state),
            padding,
        )

    def keep_carried(
        self,
        hidden: torch.Tensor,
        chunks: tuple[PrefillChunk, ...],
        row: int,
        in_buffer: bool = False,
    ) -> list[tuple[int, int]]:
        """Keep the state of each chunk that has loops to go (the next pass reads it: a
        started chunk runs every pass until done); returns (slot, row) of each prompt row
        that samples. `in_buffer`: `hidden` is a captured pass's output buffer."""
        samplers = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.samples:
                samplers.append((chunk.slot, row + n - 1))
            elif chunk.loop < (chunk.depth or self.num_loops) - 1:
                self.prefill_hidden[chunk.slot] = Carried(
                    hidden[row : row + n], row if in_buffer else None
                )
            row += n
        return samplers


def is_device_fault(error: BaseException) -> bool:
    """Whether an error came from the accelerator (sticky: every later call fails too)."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or "CUDA error" in str(error)
