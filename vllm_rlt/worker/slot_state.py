"""Per-slot device state: everything a decode row needs lives in preallocated device arrays."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_rlt.core.contract import NewSlot, Penalties
from vllm_rlt.exit.policy import Upload
from vllm_rlt.layers.penalties import apply_bad_words, apply_penalties
from vllm_rlt.layers.sampler import SamplingMode, SamplingTensors, row_sampling_mode
from vllm_rlt.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS


class PenaltyState:
    """Per-slot inputs of the logit adjustments (see layers/penalties.py), made when the
    first request that uses them is admitted; every other slot's row stays neutral."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.output_counts = torch.zeros(slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)
        self.bias = torch.zeros(slots, vocab_size, **f32)
        self.repetition = torch.ones(slots, **f32)
        self.frequency = torch.zeros(slots, **f32)
        self.presence = torch.zeros(slots, **f32)
        # Bad words: each slot's last outputs, and its words split into the part the
        # outputs must end with (right-aligned, -1 padded) and the token then barred.
        context = MAX_BAD_WORD_TOKENS - 1
        i64 = dict(dtype=torch.int64, device=device)
        self.recent = torch.full((slots, context), -1, **i64)
        self.bad_prefixes = torch.full((slots, 2 * MAX_BAD_WORDS, context), -1, **i64)
        self.bad_last_tokens = torch.full((slots, 2 * MAX_BAD_WORDS), -1, **i64)

    def set(
        self, slot: int, penalties: Penalties | None, output_token_ids: tuple[int, ...] = ()
    ) -> None:
        """Write one slot's row (neutral for None); a resumed request's outputs so far
        count toward its frequency and presence penalties and its bad words."""
        for table in (self.output_counts, self.prompt_mask, self.bias):
            table[slot] = 0
        for table in (self.recent, self.bad_prefixes, self.bad_last_tokens):
            table[slot] = -1
        if penalties is None:
            self.repetition[slot], self.frequency[slot], self.presence[slot] = 1.0, 0.0, 0.0
            return
        self.repetition[slot] = penalties.repetition
        self.frequency[slot] = penalties.frequency
        self.presence[slot] = penalties.presence
        device = self.bias.device
        if penalties.logit_bias:
            ids, values = zip(*penalties.logit_bias, strict=True)
            self.bias[slot, list(ids)] = torch.tensor(values, dtype=torch.float32, device=device)
        if penalties.allowed_token_ids:  # after the bias: no bias lets a token back in
            allowed = torch.tensor(penalties.allowed_token_ids, dtype=torch.int64, device=device)
            barred = torch.ones_like(self.prompt_mask[slot]).index_fill_(0, allowed, False)
            self.bias[slot].masked_fill_(barred, float("-inf"))
        if penalties.prompt_token_ids:
            self.prompt_mask[slot, list(penalties.prompt_token_ids)] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64, device=device)
            self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            recent = output_token_ids[-self.recent.shape[1] :]
            self.recent[slot, self.recent.shape[1] - len(recent) :] = ids[-len(recent) :]
        if penalties.bad_words:
            prefixes = torch.full(self.bad_prefixes.shape[1:], -1, dtype=torch.int64)
            for index, word in enumerate(penalties.bad_words):
                if len(word) > 1:
                    prefixes[index, prefixes.shape[1] - len(word) + 1 :] = torch.tensor(word[:-1])
            self.bad_prefixes[slot] = prefixes.to(device)
            last = [word[-1] for word in penalties.bad_words]
            self.bad_last_tokens[slot, : len(last)] = torch.tensor(last, device=device)

    def adjust(
        self, logits: torch.Tensor, slots: torch.Tensor, model_logits: torch.Tensor
    ) -> torch.Tensor:
        """The logits sampling draws from: penalties and bias, then the bad words barred.
        A row they leave without a finite logit (the request checks refuse any request
        that could reach one: engine/samplable.py) would sample NaN, in effect an arbitrary
        token; it draws instead from `model_logits` (before the min_tokens ban) with the
        bias, so still from the allowed tokens alone."""
        bias = self.bias[slots]
        adjusted = apply_penalties(
            logits,
            self.output_counts[slots],
            self.prompt_mask[slots],
            self.repetition[slots],
            self.frequency[slots],
            self.presence[slots],
            bias,
        )
        adjusted = apply_bad_words(
            adjusted, self.recent[slots], self.bad_prefixes[slots], self.bad_last_tokens[slots]
        )
        empty = adjusted.isneginf().all(dim=-1, keepdim=True)
        return torch.where(empty, model_logits + bias, adjusted)

    def count_kept(self, slots: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor) -> None:
        """Count each kept token for the penalties of later ones and append it to its slot's
        recent outputs (the bad words' context)."""
        self.output_counts.index_put_((slots, tokens), kept.int(), accumulate=True)
        recent = self.recent[slots]
        shifted = torch.cat([recent[:, 1:], tokens.unsqueeze(1)], 1)
        self.recent[slots] = torch.where(kept.unsqueeze(1), shifted, recent)


class SlotState:
    """Arrays indexed by slot; index `max_slots` is a dummy slot that padding rows may use.

    A decode row gathers its input from here (the next token's embedding when `loop == 0`,
    else the carried hidden state) and scatters its result back, so the host never has to
    know, before a pass, which tokens exited in the previous one.
    """

    def __init__(
        self,
        max_slots: int,
        hidden_size: int,
        vocab_size: int,
        max_blocks_per_seq: int,
        dummy_block: int,
        dtype: torch.dtype,
        device: torch.device,
        table_planes: int = 1,
        exit_sync: bool = False,
    ) -> None:
        n = max_slots + 1
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        # [slots, carried width] what a row carries from one loop to the next
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.loop = torch.zeros(n, **i64)  # [slots] loops finished by the current token
        # [slots] passes a token has waited to exit with others (worker/exit_sync.py)
        self.exit_wait = torch.zeros(n, **i64) if exit_sync else None
        self.position = torch.zeros(n, **i64)  # [slots] position of the current token
        self.token = torch.zeros(n, **i64)  # [slots] current input token
        self.num_generated = torch.zeros(n, **i64)  # [slots] tokens sampled so far
        # a request's settings, each column named as the SamplingRecord field it holds
        self.min_loops = torch.ones(n, **i64)  # [slots]
        self.max_loops = torch.ones(n, **i64)  # [slots]
        self.exit_threshold = torch.ones(n, **f32)  # [slots]
        self.min_tokens = torch.zeros(n, **i64)  # [slots]
        self.sampling = SamplingTensors.filled(n, device)  # [slots] per column
        self.banned = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)  # [slots, vocab]
        self.table_planes = table_planes
        self.block_table = torch.full(
            (n * table_planes, max_blocks_per_seq), dummy_block, **i64
        )  # [slots * table_planes, blocks]: row slot * table_planes + plane
        self.dummy_block = dummy_block
        self.num_logprobs = [0] * n  # host copy: how many top logprobs each slot wants
        self.sampling_mode = [SamplingMode.GREEDY] * n  # host copy: what each slot needs
        self.adjusted = [False] * n  # host copy: the slot's request adjusts its logits
        self.penalties: PenaltyState | None = None
        self.vocab_size = vocab_size

    def admit(self, news: Sequence[NewSlot], upload: Upload | None = None) -> torch.Tensor | None:
        """Write the rows of newly admitted requests, for all of them at once: a few
        uploads and one indexed write per field, however many requests a pass admits (a
        write per request and field would cost each request tens of kernel launches). Each
        column takes the record's field of its name (`request_columns`).
        `upload` sends an int64 host tensor to the device without waiting for it (default:
        a plain copy, which waits for the pass in flight). `admit_extras` then writes what
        only a few requests have. Returns the admitted slots on the device (None: none)."""
        if not news:
            return None
        device = self.hidden.device
        send = upload or (lambda values: values.to(device))
        slots = send(torch.tensor([new.slot for new in news], dtype=torch.int64))
        columns = self.request_columns()
        ints = [name for name, column in columns.items() if not column.is_floating_point()]
        floats = [name for name in columns if name not in ints]
        int_rows = torch.tensor(
            [
                [new.prompt_len, new.num_generated] + [getattr(new.sampling, f) for f in ints]
                for new in news
            ],
            dtype=torch.int64,
        )
        # float64 bits travel as int64; float32 on the device rounds as torch.tensor would
        float_rows = torch.tensor(
            [[getattr(new.sampling, name) for name in floats] for new in news],
            dtype=torch.float64,
        ).view(torch.int64)
        int_rows = send(int_rows.flatten()).view(len(news), -1)
        float_rows = send(float_rows.flatten()).view(torch.float64).float().view(len(news), -1)
        self.position[slots], self.num_generated[slots] = int_rows[:, 0], int_rows[:, 1]
        for name, values in zip(ints, int_rows[:, 2:].unbind(1), strict=True):
            columns[name][slots] = values
        for name, values in zip(floats, float_rows.unbind(1), strict=True):
            columns[name][slots] = values
        self.loop[slots] = 0
        if self.exit_wait is not None:
            self.exit_wait[slots] = 0
        self.banned[slots] = False
        planes = torch.arange(self.table_planes, device=device)
        self.block_table[(slots.unsqueeze(1) * self.table_planes + planes).flatten()] = (
            self.dummy_block
        )  # its blocks come as they are taken
        # Tokens banned before min_tokens: (slot, token id) pairs.
        banned = [(n.slot, t) for n in news for t in n.sampling.banned_until_min_tokens]
        if banned:
            rows, ids = send(torch.tensor(banned, dtype=torch.int64).T.flatten()).view(2, -1)
            self.banned[rows, ids] = True
        for new in news:
            self.num_logprobs[new.slot] = new.sampling.num_logprobs
            self.sampling_mode[new.slot] = row_sampling_mode(new.sampling)
        return slots

    def request_columns(self) -> dict[str, torch.Tensor]:
        """Every per-slot column admission writes from a request's `SamplingRecord`, under
        the record's field name."""
        return {
            "min_loops": self.min_loops,
            "max_loops": self.max_loops,
            "exit_threshold": self.exit_threshold,
            "min_tokens": self.min_tokens,
            **self.sampling.columns(),
        }

    def admit_extras(self, new: NewSlot) -> None:
        """The parts of a newly admitted request's row that only some requests have (after
        `admit`): a resumed request's next input and its logit adjustments."""
        s = new.slot
        if new.first_token >= 0:  # resumed: its next decode input is already known
            self.token[s] = new.first_token
        penalties = new.sampling.penalties
        if penalties is not None and self.penalties is None:
            self.penalties = PenaltyState(
                len(self.sampling_mode), self.vocab_size, self.hidden.device
            )
        if self.penalties is not None:
            self.penalties.set(s, penalties, new.output_token_ids)
        self.adjusted[s] = penalties is not None

    def clear_tables(self, slot: int) -> None:
        """Point every table row of `slot` at the dummy block."""
        first = slot * self.table_planes
        self.block_table[first : first + self.table_planes] = self.dummy_block

    def reset_dummy(self, slot: int) -> None:
        """Padding rows advance the dummy slot like a real one; pin it back to position 0."""
        # fill_ rather than item assignment: no host-to-device copy inside a CUDA graph.
        for field in (self.position, self.loop, self.num_generated, self.exit_wait):
            if field is not None:
                field[slot : slot + 1].fill_(0)
