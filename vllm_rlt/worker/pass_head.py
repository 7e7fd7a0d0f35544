"""What every pass runs after the layer stack, as one fixed pipeline: the decode rows'
exits, sampling where rows exit and on the prompt rows that sample, the slot state scattered
back, and the packed results. Eager passes, decode graphs and prompt-pass graphs all run it;
speculation lanes (`SpecLanes`) and logit adjustments (`PenaltyState`) plug in where they
act."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_rlt.core.contract import ModelRunnerOutput, SampledToken
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy
from vllm_rlt.layers.sampler import SamplingMode, TokenBan, top_logprobs
from vllm_rlt.models.interface import LoopedModel
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.worker.exit_sync import ExitSync, SyncedExits
from vllm_rlt.worker.pass_inputs import KVGeometry, decode_row_fields
from vllm_rlt.worker.slot_state import SlotState
from vllm_rlt.worker.spec_lanes import SpecLanes

# Fields packed per sampling row before the top logprobs: exited, token, depth, logprob,
# for self-speculation the draft's outcome (0 none, 1 accepted, 2 refused) and its lead, and
# the token's rank.
PACKED_FIELDS = 7


@dataclass
class Exits:
    """The decode rows after the exit policy (and, with lanes, after holding lanes back):
    which exit, their state to keep, and where they are."""

    exited: torch.Tensor  # [decode rows] bool
    carried: dict[str, torch.Tensor]  # the exit policy's values for the next loop
    loops_done: torch.Tensor  # the depth each row has reached
    hidden: torch.Tensor  # [decode rows, carried_width] what each row keeps
    readout: torch.Tensor  # [decode rows, hidden] what each row samples from if it exits
    positions: torch.Tensor
    logits: torch.Tensor | None = None  # [decode rows, vocab] when the policy read them
    held_back: torch.Tensor | None = None  # [decode rows] rows waiting to exit (ExitSync)
    drafting: torch.Tensor | None = None  # lanes only
    hold: Any = None  # lanes only: what `SpecLanes.step` needs of the held lanes


@dataclass
class SampleRows:
    """The rows that may sample: every decode row (kept only where it exits), then the last
    position of each prompt that just finished its last loop."""

    hidden: torch.Tensor
    slots: torch.Tensor
    live: torch.Tensor  # rows whose token counts (padding rows of a graph never do)
    head: torch.Tensor  # rows that need the LM head (drafting lanes too)
    prompt_samples: bool

    @classmethod
    def of(cls, exits: Exits, decode, p_hidden, p_slots, dummy_slot: int, lanes) -> SampleRows:
        """`p_hidden`: the readout of the prompt rows that sample."""
        hidden, slots = exits.readout, decode
        live = exits.exited & (decode != dummy_slot)
        prompt_samples = p_slots.shape[0] > 0
        if prompt_samples:
            hidden = torch.cat([exits.readout, p_hidden])
            slots = torch.cat([decode, p_slots])
            live = torch.cat([live, p_slots != dummy_slot])
        head = live
        if lanes is not None:
            head = live | torch.cat([exits.drafting, torch.zeros_like(live[decode.shape[0] :])])
        return cls(hidden, slots, live, head, prompt_samples)


@dataclass
class Sampled:
    """What sampling chose per sampling row, with its logprobs and the lanes' outcome."""

    tokens: torch.Tensor
    chosen_lp: torch.Tensor
    rank: torch.Tensor  # the chosen token's among all tokens, 1-based
    top_ids: torch.Tensor
    top_lp: torch.Tensor
    outcome: torch.Tensor  # the draft's: 0 none, 1 accepted, 2 refused
    ahead: torch.Tensor  # how far ahead the draft was
    spec: tuple[torch.Tensor, torch.Tensor] | None  # lanes only: (accepted, probs)


class PassHead:
    """Holds what the pipeline reads and writes: the slot state, the model's LM head, the
    exit policy and the lanes."""

    def __init__(
        self,
        model: LoopedModel,
        ops: LoopOps,
        state: SlotState,
        geo: KVGeometry,
        exit_policy: ExitPolicy,
        lanes: SpecLanes | None,
        dummy_slot: int,
        sync: ExitSync | None = None,
    ) -> None:
        self.model, self.ops, self.state, self.geo = model, ops, state, geo
        self.exit_policy, self.lanes, self.dummy_slot = exit_policy, lanes, dummy_slot
        self.sync = sync
        self.num_loops = model.config.num_loops
        self.state_width = model.config.hidden_size  # the carried columns policies read
        exit_policy.bind(state.loop.shape[0], state.loop.device)  # its per-slot state

    def readout_rows(
        self,
        d_hidden: torch.Tensor,
        decode: torch.Tensor,
        d_loops: torch.Tensor,
        lanes: SpecLanes | None = None,
    ) -> tuple[torch.Tensor, SyncedExits | None, torch.Tensor]:
        """For a model that reads out apart: ([decode rows] bool, the rows the readout must
        run for; the decode rows' exits decided before the readout, for `run`'s `decided`,
        so both stages act on one decision; what the readout reads). A policy that reads
        the logits needs every decode row read out, and decides in `run` (None). With
        `lanes`, drafting lanes read out too, a held lane (only when it exits) from the
        state it kept, and the lanes' events are the ones `run` finds again."""
        carried = d_hidden
        if lanes is not None:
            held = lanes.holding(decode).unsqueeze(1)
            carried = torch.where(held, self.state.hidden[decode], d_hidden)
        if self.exit_policy.needs_logits:
            return torch.ones_like(decode, dtype=torch.bool), None, carried
        _, decided = self._decision(d_hidden, decode, d_loops + 1, None)
        live = decided.exit
        if lanes is not None:
            positions = self.state.position[decode]
            exited, drafting, _, _ = lanes.events(decode, positions, d_loops + 1, live)
            live = exited | drafting
        return live & (decode != self.dummy_slot), decided, carried  # padding never reads out

    def run(
        self,
        d_hidden: torch.Tensor,  # [decode rows, carried_width] what this loop left
        d_readout: torch.Tensor,  # [decode rows, hidden] what an exiting row samples from
        decode: torch.Tensor,  # [decode rows] slots
        p_hidden: torch.Tensor,  # [prompt samplers, hidden] their readout
        p_slots: torch.Tensor,  # [prompt samplers] slots (the dummy: padding)
        mode: SamplingMode,
        num_top: int,
        adjusted: bool,
        speculating: bool,
        d_loops: torch.Tensor | None = None,  # [decode rows] the loop each ran, if known
        decided: SyncedExits | None = None,  # from `readout_rows`
    ) -> torch.Tensor:
        """After the layer stack, one fixed pipeline: the decode rows' exits, sampling where
        rows exit and on the prompt rows that sample, the slot state scattered back, and the
        packed results [decode rows + prompt samplers, PACKED_FIELDS + 2 * num_top].
        Speculation lanes (`SpecLanes`) and logit adjustments (`PenaltyState`) plug in where
        they act. Every shape depends only on the row counts, so it is captured as it is."""
        lanes = self.lanes if speculating else None
        exits = self._exits(d_hidden, d_readout, decode, d_loops, lanes, decided)
        rows = SampleRows.of(exits, decode, p_hidden, p_slots, self.dummy_slot, lanes)
        sampled = self._sample(rows, exits, decode, mode, num_top, adjusted, lanes)
        self._scatter(exits, decode, p_slots, sampled.tokens, lanes, sampled.spec)
        depths, flags = exits.loops_done, exits.exited
        if rows.prompt_samples:
            depths = torch.cat([depths, torch.full_like(p_slots, self.num_loops)])
            flags = torch.cat([flags, torch.ones_like(p_slots, dtype=torch.bool)])
        fields = torch.stack(
            [
                flags.float(),
                sampled.tokens.float(),
                depths.float(),
                sampled.chosen_lp,
                sampled.outcome,
                sampled.ahead,
                sampled.rank.float(),
            ],
            1,
        )
        return torch.cat([fields, sampled.top_ids.float(), sampled.top_lp], dim=1)

    def _exits(
        self,
        d_hidden: torch.Tensor,
        d_readout: torch.Tensor,
        decode: torch.Tensor,
        d_loops: torch.Tensor | None,
        lanes: SpecLanes | None,
        decided: SyncedExits | None,
    ) -> Exits:
        """Which decode rows leave after this loop (the exit policy, or `decided` where the
        pass decided before the readout), and with lanes which are held back or draft."""
        st = self.state
        if d_loops is None:
            d_loops = decode_row_fields(decode, st, self.geo, lanes).loops
        loops_done = d_loops + 1
        logits = self.model.coda(d_readout, self.ops) if self.exit_policy.needs_logits else None
        decision, synced = self._decision(d_hidden, decode, loops_done, logits)
        if decided is not None:  # the rows that were read out: the decision taken once
            synced = decided
        positions = st.position[decode]
        exits = Exits(
            exited=synced.exit,
            carried=decision.carried,
            loops_done=loops_done,
            hidden=d_hidden,
            readout=d_readout,
            positions=positions,
            logits=logits,
            held_back=synced.held_back,
        )
        if lanes is not None:
            exited, exits.drafting, held, exits.hold = lanes.events(
                decode, exits.positions, loops_done, exits.exited
            )
            # A held lane keeps its state; released, it samples from the state it exited
            # with, at the depth it exited at.
            exits.exited = exited
            exits.hidden = torch.where(held.unsqueeze(1), st.hidden[decode], d_hidden)
            if not self.model.separate_readout:  # else read out from it (`readout_rows`)
                exits.readout = exits.hidden
            exits.loops_done = torch.where(held, st.loop[decode], loops_done)
            before = self.exit_policy.gather(decode)
            exits.carried = {
                name: _by_row(held, before[name], values) for name, values in exits.carried.items()
            }
        return exits

    def _decision(
        self,
        d_hidden: torch.Tensor,
        decode: torch.Tensor,
        loops_done: torch.Tensor,
        logits: torch.Tensor | None,
    ) -> tuple[ExitDecision, SyncedExits]:
        """The exit policy's decision for the decode rows after loop `loops_done`, and
        which rows exit now (with `sync`, wanting rows may be held back)."""
        st, policy = self.state, self.exit_policy
        decision = policy.decide(
            ExitInputs(
                hidden=d_hidden[:, : self.state_width],
                slots=decode,
                num_generated=st.num_generated[decode],
                loops_done=loops_done,
                min_loops=st.min_loops[decode],
                max_loops=st.max_loops[decode],
                exit_threshold=st.exit_threshold[decode],
                carried=policy.gather(decode),
                positions=st.position[decode],
                seeds=st.sampling.seed[decode] if policy.needs_seeds else None,
                logits=logits,
            )
        )
        if self.sync is None:
            return decision, SyncedExits(decision.exit, None)
        return decision, self.sync.decide(decision.exit, decode)

    def _sample(
        self,
        rows: SampleRows,
        exits: Exits,
        decode: torch.Tensor,
        mode: SamplingMode,
        num_top: int,
        adjusted: bool,
        lanes: SpecLanes | None,
    ) -> Sampled:
        """The LM head, the sampler, the lanes' choice between draft and own token, the
        kept tokens counted for the logit adjustments, and the logprobs."""
        st = self.state
        if lanes is None and exits.logits is None and num_top == 0:
            if mode != SamplingMode.FILTERED and not (adjusted and st.penalties is not None):
                return self._sample_in_one_read(rows, mode)
        num_decode = decode.shape[0]
        slots, live = rows.slots, rows.live
        logits, sampled_from = self._logits(rows, exits.logits, adjusted)
        greedy = mode == SamplingMode.GREEDY
        # All greedy, nothing adjusting the logits: the token and its logprob and rank in
        # one read of the logits (the ops' token_stats).
        fused = greedy and lanes is None and sampled_from is logits
        chosen_lp = rank = None
        if fused:
            tokens, chosen_lp, rank = self.ops.token_stats(logits, None)
        elif greedy:
            tokens = sampled_from.argmax(dim=-1)
        elif mode == SamplingMode.PLAIN:  # no row filters: no sort
            temperature, seeds = st.sampling.temperature[slots], st.sampling.seed[slots]
            counters = st.num_generated[slots]
            tokens = self.ops.sample_plain(sampled_from, temperature, seeds, counters)
        else:
            settings, counters = st.sampling.rows(slots), st.num_generated[slots]
            tokens = self.ops.sample_filtered(sampled_from, settings, counters)
        outcome = ahead = torch.zeros_like(live, dtype=torch.float32)
        spec = None
        if lanes is not None:
            spec_tokens, accepted, had_draft, probs = lanes.choose(
                st,
                decode,
                exits.positions,
                logits[:num_decode],
                exits.exited,
                tokens[:num_decode],
                greedy,
            )
            is_lane = lanes.is_lane[decode]
            tokens = torch.cat(
                [torch.where(is_lane, spec_tokens, tokens[:num_decode]), tokens[num_decode:]]
            )
            pad = torch.zeros_like(live[num_decode:], dtype=torch.float32)
            drafted_outcome = torch.where(accepted, 1.0, 2.0) * had_draft
            outcome = torch.cat([drafted_outcome, pad])
            ahead = torch.cat([lanes.drafted_ahead(decode).float() * had_draft, pad])
            spec = (accepted, probs)
        if adjusted and st.penalties is not None:
            st.penalties.count_kept(slots, tokens, live)
        if rank is None:
            _, chosen_lp, rank = self.ops.token_stats(logits, tokens)
        top_lp, top_ids = top_logprobs(logits, num_top)
        return Sampled(tokens, chosen_lp, rank, top_ids, top_lp, outcome, ahead, spec)

    def _sample_in_one_read(self, rows: SampleRows, mode: SamplingMode) -> Sampled:
        """Rows that filter nothing, with no logit adjustment and no top logprobs asked:
        the kernels read the LM head's own dtype and the min_tokens ban beside it, so no
        float32 copy and no masked copy of the logits is written (at 512 rows of Ouro's
        vocabulary those were three passes over 100 MB)."""
        st, slots = self.state, rows.slots
        logits = self.model.coda(rows.hidden, self.ops, rows.head, upcast=False)
        ban = self._ban(slots)
        if mode == SamplingMode.GREEDY:
            tokens, chosen_lp, rank = self.ops.token_stats(logits, None, ban, rows.live)
        else:
            temperature, seeds = st.sampling.temperature[slots], st.sampling.seed[slots]
            counters = st.num_generated[slots]
            tokens = self.ops.sample_plain(logits, temperature, seeds, counters, ban)
            _, chosen_lp, rank = self.ops.token_stats(logits, tokens, ban, rows.live)
        none = torch.zeros_like(rows.live, dtype=torch.float32)
        top_lp, top_ids = none.new_empty(none.shape[0], 0), tokens.new_empty(tokens.shape[0], 0)
        return Sampled(tokens, chosen_lp, rank, top_ids, top_lp, none, none, None)

    def _ban(self, slots: torch.Tensor) -> TokenBan:
        """The min_tokens ban of the sampling rows `slots`."""
        st = self.state
        return TokenBan(st.banned, slots, st.num_generated[slots] < st.min_tokens[slots])

    def _scatter(
        self,
        exits: Exits,
        decode: torch.Tensor,
        p_slots: torch.Tensor,
        tokens: torch.Tensor,
        lanes: SpecLanes | None,
        spec: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Write each row's result back into its slot's state."""
        st = self.state
        num_decode = decode.shape[0]
        exited = exits.exited
        st.token[decode] = torch.where(exited, tokens[:num_decode], st.token[decode])
        st.position[decode] += exited.long()
        loops, carried = exits.loops_done, exits.carried
        if exits.held_back is not None:  # a held row runs its last loop again, as it was
            assert self.sync is not None
            held = exits.held_back
            loops = torch.where(held, loops - 1, loops)
            before = self.exit_policy.gather(decode)
            carried = {name: _by_row(held, before[name], v) for name, v in carried.items()}
            self.sync.store(decode, held)
        st.loop[decode] = torch.where(exited, 0, loops)
        self.exit_policy.store(decode, carried, exited)
        st.num_generated[decode] += exited.long()
        st.hidden[decode] = exits.hidden
        if lanes is not None:
            assert spec is not None
            accepted, probs = spec
            lanes.step(
                st,
                self.exit_policy,
                decode,
                exits.positions,
                exited,
                exits.drafting,
                exits.hold,
                accepted,
                tokens[:num_decode],
                probs,
            )
        if p_slots.shape[0] > 0:
            st.token[p_slots] = tokens[num_decode:]
            st.num_generated.index_fill_(0, p_slots, 1)  # no host copy inside a graph
        st.reset_dummy(self.dummy_slot)

    def _logits(self, rows: SampleRows, decode_logits: torch.Tensor | None, adjusted: bool):
        """(the model's logits, what sampling draws from: with the min_tokens ban and the
        logit adjustments) of the rows; the LM head may skip rows outside `rows.head`, and
        reuses the decode rows' logits where the exit policy had them computed."""
        st, slots = self.state, rows.slots
        if decode_logits is None:
            model_logits = self.model.coda(rows.hidden, self.ops, rows.head)  # [samplers, vocab]
        else:
            prompt = rows.hidden[decode_logits.shape[0] :]
            model_logits = torch.cat([decode_logits, self.model.coda(prompt, self.ops)])
        logits = self._ban(slots).apply(model_logits)
        if not adjusted or st.penalties is None:
            return logits, logits
        return logits, st.penalties.adjust(logits, slots, model_logits)

    def results(self, packed: list[list[float]], slots: list[int]) -> ModelRunnerOutput:
        """`run`'s packed rows, read back to the host, as the runner's output: a token for
        each row that exited (the slot `slots` names), the others continuing."""
        sampled, continuing = [], []
        for slot, values in zip(slots, packed, strict=True):
            if slot == self.dummy_slot:  # a padding row of a captured mixed pass
                continue
            if not values[0]:
                continuing.append(slot)
                continue
            want = self.state.num_logprobs[slot]
            num_top = (len(values) - PACKED_FIELDS) // 2
            top = tuple(
                (int(values[PACKED_FIELDS + j]), values[PACKED_FIELDS + num_top + j])
                for j in range(min(want, num_top))
            )
            outcome = int(values[4])
            sampled.append(
                SampledToken(
                    slot,
                    int(values[1]),
                    int(values[2]),
                    values[3],
                    top,
                    drafted=outcome > 0,
                    accepted=outcome == 1,
                    ahead=int(values[5]),
                    rank=int(values[6]),
                )
            )
        return ModelRunnerOutput(tuple(sampled), tuple(continuing))


def _by_row(rows: torch.Tensor, chosen: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """torch.where over the first dimension: `chosen`'s row where `rows` ([rows] bool)."""
    return torch.where(rows.view(-1, *([1] * (other.dim() - 1))), chosen, other)
