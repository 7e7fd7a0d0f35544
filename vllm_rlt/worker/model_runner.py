"""ModelRunner: turns a SchedulerOutput into one pass over the shared layer stack."""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.core.contract import ModelRunnerOutput, SampledToken, SchedulerOutput
from vllm_rlt.exit import ExitInputs, ExitPolicy
from vllm_rlt.layers.sampler import sample, token_logprobs
from vllm_rlt.worker.pass_inputs import KVGeometry, build_metadata, gather_rows
from vllm_rlt.worker.slot_state import SlotState


class ModelRunner:
    """Owns the model, the KV cache, per-slot device state, and executes passes.

    One pass: gather row inputs (embedding for loop-0 rows, carried state otherwise), run
    one loop of the layer stack, decide exits and sample on the device, scatter state back,
    and read the results back to the host once.
    """

    def __init__(
        self,
        model,
        geometry: KVGeometry,
        max_slots: int,
        max_model_len: int,
        exit_policy: ExitPolicy,
        ops: Any,
        trace_len: int,
    ) -> None:
        cfg = model.config
        self.model = model
        self.geo = geometry
        self.exit_policy = exit_policy
        self.ops = ops
        self.num_loops = cfg.num_loops
        entries = geometry.planes * geometry.slots_per_plane
        shape = (entries, cfg.num_key_value_heads, cfg.head_dim)
        # Zeroed, not empty: masked keys must still hold finite values.
        self.k_caches = [
            torch.zeros(shape, dtype=model.dtype, device=model.device)
            for _ in range(cfg.num_hidden_layers)
        ]  # per layer [planes * slots_per_plane, kv_heads, head_dim]
        self.v_caches = [torch.zeros_like(k) for k in self.k_caches]
        self.state = SlotState(
            max_slots,
            cfg.hidden_size,
            cfg.vocab_size,
            -(-max_model_len // geometry.block_size),
            geometry.num_blocks,
            trace_len,
            model.dtype,
            model.device,
        )
        self.prefill_hidden: dict[int, torch.Tensor] = {}  # slot -> [chunk, hidden]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        st, model = self.state, self.model
        for new in out.new_slots:
            st.admit(new)
            self.prefill_hidden.pop(new.slot, None)
        rows = gather_rows(out, st, self.geo)
        num_decode = len(out.decode_slots)
        decode = rows.slots[:num_decode]  # [decode]
        d_loops = rows.loops[:num_decode]

        inputs = [
            torch.where(
                (d_loops == 0).unsqueeze(1), model.prelude(st.token[decode]), st.hidden[decode]
            )
        ]
        for chunk in out.prefill_chunks:
            if chunk.loop == 0:
                ids = torch.tensor(chunk.token_ids, dtype=torch.int64, device=model.device)
                inputs.append(model.prelude(ids))
            else:
                inputs.append(self.prefill_hidden.pop(chunk.slot))
        hidden = torch.cat(inputs)  # [rows, hidden]
        meta = build_metadata(rows, st, self.geo, out.max_context, self.ops.needs_segments)
        hidden = model.core(hidden, meta, self.k_caches, self.v_caches, self.ops)

        # Decode rows: exit test on the device.
        d_hidden = hidden[:num_decode]
        loops_done = d_loops + 1
        trace_index = (st.num_generated[decode] - 1).clamp(0, st.trace.shape[1] - 1)
        decision = self.exit_policy.decide(
            ExitInputs(
                hidden=d_hidden,
                loops_done=loops_done,
                min_loops=st.min_loops[decode],
                max_loops=st.max_loops[decode],
                threshold=st.threshold[decode],
                survival=st.survival[decode],
                pending=st.pending[decode],
                target_depth=st.trace[decode, trace_index],
            )
        )

        # Rows that may sample: every decode row (kept only where it exits), and the last
        # position of each prompt that just finished its last loop.
        sample_rows, sample_slots, row = (
            [torch.arange(num_decode, device=model.device)],
            [decode],
            num_decode,
        )
        prefill_samplers = []
        for chunk in out.prefill_chunks:
            n = len(chunk.token_ids)
            if chunk.samples:
                prefill_samplers.append(chunk.slot)
                sample_rows.append(torch.tensor([row + n - 1], device=model.device))
            elif chunk.loop < self.num_loops - 1:
                self.prefill_hidden[chunk.slot] = hidden[row : row + n]
            row += n
        p_slots = torch.tensor(prefill_samplers, dtype=torch.int64, device=model.device)
        sample_slots.append(p_slots)
        s_rows, s_slots = torch.cat(sample_rows), torch.cat(sample_slots)
        host_slots = list(out.decode_slots) + prefill_samplers
        num_top = max((st.num_logprobs[s] for s in host_slots), default=0)
        tokens, chosen_lp, top_ids, top_lp = self._sample(hidden[s_rows], s_slots, num_top)

        exited = decision.exit
        d_tokens = tokens[:num_decode]
        st.token[decode] = torch.where(exited, d_tokens, st.token[decode])
        st.position[decode] += exited.long()
        st.loop[decode] = torch.where(exited, 0, loops_done)
        st.survival[decode] = torch.where(exited, 1.0, decision.survival)
        st.pending[decode] = decision.pending & ~exited
        st.num_generated[decode] += exited.long()
        st.hidden[decode] = d_hidden
        if prefill_samplers:
            st.token[p_slots] = tokens[num_decode:]
            st.num_generated[p_slots] = 1

        depths = torch.cat([loops_done, torch.full_like(p_slots, self.num_loops)])
        flags = torch.cat([exited, torch.ones_like(p_slots, dtype=torch.bool)])
        packed = torch.cat(
            [
                torch.stack(
                    [flags.double(), tokens.double(), depths.double(), chosen_lp.double()], 1
                ),
                top_ids.double(),
                top_lp.double(),
            ],
            dim=1,
        ).tolist()  # the one device-to-host read of the pass
        return self._to_output(packed, host_slots, num_top)

    def _sample(self, hidden: torch.Tensor, slots: torch.Tensor, num_top: int):
        st = self.state
        logits = self.model.coda(hidden)  # [samplers, vocab]
        before_min = st.num_generated[slots] < st.min_tokens[slots]
        logits = logits.masked_fill(st.banned[slots] & before_min.unsqueeze(1), float("-inf"))
        tokens = sample(
            logits,
            st.temperature[slots],
            st.top_k[slots],
            st.top_p[slots],
            st.min_p[slots],
            st.seed[slots],
            st.num_generated[slots],
        )
        chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
        return tokens, chosen, top_ids, top_lp

    def _to_output(
        self, packed: list[list[float]], slots: list[int], num_top: int
    ) -> ModelRunnerOutput:
        sampled, continuing = [], []
        for slot, values in zip(slots, packed, strict=True):
            if not values[0]:
                continuing.append(slot)
                continue
            want = self.state.num_logprobs[slot]
            top = tuple(
                (int(values[4 + j]), values[4 + num_top + j]) for j in range(min(want, num_top))
            )
            sampled.append(SampledToken(slot, int(values[1]), int(values[2]), values[3], top))
        return ModelRunnerOutput(tuple(sampled), tuple(continuing))
