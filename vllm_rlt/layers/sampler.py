"""Batched sampling on the device: greedy, temperature, top-n-sigma/top-k/top-p/min-p,
seeded per row."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import torch

_MASK32 = 0xFFFFFFFF


class SamplingMode(IntEnum):
    """What a pass's sampling rows need, known on the host (a graph key): all greedy; some
    sample with no filter (one Gumbel-max read of each row's logits, `sample_plain`); some
    filter (top-n-sigma, top-k, top-p or min-p: where they cut each row is found first,
    `sample`). A pass takes the largest of its rows' modes."""

    GREEDY = 0
    PLAIN = 1
    FILTERED = 2


def row_sampling_mode(record: Any) -> SamplingMode:
    """The mode one request's sampling fields need (a `SamplingRecord`)."""
    if record.temperature == 0.0:
        return SamplingMode.GREEDY
    filters = (
        record.top_k > 0,
        record.top_p < 1.0,
        record.min_p > 0.0,
        record.top_n_sigma > 0.0,
    )
    return SamplingMode.FILTERED if any(filters) else SamplingMode.PLAIN


@dataclass
class TokenBan:
    """The tokens a row may not draw yet (its EOS and stop ids before min_tokens), applied
    where the logits are read rather than written out as a masked copy: `table` [slots,
    vocab] bool, and per sampling row its slot and whether the ban holds now."""

    table: torch.Tensor  # [slots, vocab] bool
    slots: torch.Tensor  # [rows] int64
    active: torch.Tensor  # [rows] bool

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, vocab] with -inf at the banned tokens of the rows it holds for."""
        banned = self.table[self.slots] & self.active.unsqueeze(1)
        return logits.masked_fill(banned, float("-inf"))


def _column(neutral: float | int) -> Any:
    """A per-row column whose value `neutral` leaves sampling as it is (an int: int64 on the
    device, a float: float32)."""
    return field(metadata={"neutral": neutral})


@dataclass
class SamplingTensors:
    """The sampling settings of rows, one device column per field, named as the request's
    `SamplingRecord` field it comes from: the slot state holds one per slot and writes it
    by name at admission, and a pass hands the sampler the rows it samples (`rows`)."""

    temperature: torch.Tensor = _column(0.0)  # [rows] float32; 0 = greedy
    top_k: torch.Tensor = _column(0)  # [rows] int64; 0 = every token
    top_p: torch.Tensor = _column(1.0)  # [rows] float32; 1 = every token
    min_p: torch.Tensor = _column(0.0)  # [rows] float32; 0 = every token
    top_n_sigma: torch.Tensor = _column(0.0)  # [rows] float32; <= 0 = every token
    seed: torch.Tensor = _column(0)  # [rows] int64

    @classmethod
    def filled(
        cls, rows: int, device: torch.device | str | None = None, **values: Any
    ) -> SamplingTensors:
        """`rows` rows at each column's neutral value, except the columns named in `values`
        (a number for every row, or a tensor of one per row)."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"SamplingTensors has no column {sorted(unknown)[0]!r}")
        columns = {}
        for column in fields(cls):
            neutral = column.metadata["neutral"]
            dtype = torch.int64 if isinstance(neutral, int) else torch.float32
            value = torch.as_tensor(values.get(column.name, neutral), dtype=dtype, device=device)
            columns[column.name] = value.expand(rows).clone()
        return cls(**columns)

    def rows(self, index: torch.Tensor) -> SamplingTensors:
        """The settings of the rows `index` picks."""
        return SamplingTensors(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def columns(self) -> dict[str, torch.Tensor]:
        """Each column by its field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [rows, vocab] that depends only on (seed, counter, token id).

    A counter-based hash instead of a stateful generator: a row's noise does not depend on
    which other rows share the batch, so a seeded request samples the same text anywhere.
    """
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    base = _mix32(_mix32(seed_lo ^ _mix32((seed_hi + 0x9E3779B9) & _MASK32)) ^ (counters & _MASK32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(base.unsqueeze(1) ^ _mix32(ids + 0x632BE5AB).unsqueeze(0))
    return ((bits >> 8).double() + 0.5) / float(1 << 24)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [rows, vocab] float64 from `seeded_uniform`: the draw is the argmax of
    scaled logits plus this noise, whatever order the tokens are visited in."""
    return -torch.log(-torch.log(seeded_uniform(seeds, counters, vocab)))


def sample_plain(
    logits: torch.Tensor,  # [rows, vocab] float32
    temperature: torch.Tensor,  # [rows] float32; 0 = greedy
    seeds: torch.Tensor,  # [rows] int64
    counters: torch.Tensor,  # [rows] int64
) -> torch.Tensor:
    """The token `sample` draws for rows that filter nothing, without its sort: the same
    noise per (seed, counter, token id), so the same token (the torch form of
    LoopOps.sample_plain). Greedy rows take the first maximum, as torch.argmax."""
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    noise = gumbel_noise(seeds, counters, logits.shape[-1])
    drawn = (scaled.double() + noise).argmax(dim=-1)
    return torch.where(temperature == 0.0, logits.argmax(dim=-1), drawn)


def sample(
    logits: torch.Tensor,  # [rows, vocab] float32
    settings: SamplingTensors,  # [rows] each
    counters: torch.Tensor,  # [rows] int64, the index of the token being sampled
) -> torch.Tensor:
    """Sampled token ids [rows], all rows at once with no per-row Python loop (the torch
    form of LoopOps.sample_filtered). The filters are found on the distribution sorted by
    logit, ties by token id, and put back in token order (-inf where they drop a token);
    the token is then the argmax of the kept scaled logits plus the seeded Gumbel noise,
    which does not depend on the order tokens are visited in (an exact tie, about 2^-24
    likely for two equal logits, goes to the lower token id). So a backend may find where
    the filters cut without sorting, and draw in one read with no [rows, vocab] noise."""
    greedy_ids = logits.argmax(dim=-1)
    sorted_logits, sorted_ids = _filtered_sorted(logits, settings)
    kept = torch.empty_like(sorted_logits).scatter_(1, sorted_ids, sorted_logits)
    unscaled = torch.ones_like(settings.temperature)  # `kept` is scaled already
    sampled_ids = sample_plain(kept, unscaled, settings.seed, counters)
    return torch.where(settings.temperature == 0.0, greedy_ids, sampled_ids)


def top_n_sigma(scaled: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`scaled` [rows, vocab] with -inf where a logit lies more than n [rows] standard
    deviations below its row's largest (rows with n <= 0 unchanged). The deviation is that
    of the row's finite logits: a token already barred is no candidate."""
    finite = scaled.isfinite()
    count = finite.sum(dim=-1, keepdim=True)
    mean = torch.where(finite, scaled, 0.0).sum(dim=-1, keepdim=True) / count.clamp_min(1)
    squares = torch.where(finite, scaled - mean, 0.0).square().sum(dim=-1, keepdim=True)
    deviation = (squares / (count - 1).clamp_min(1)).sqrt()
    floor = scaled.max(dim=-1, keepdim=True).values - n.unsqueeze(1) * deviation
    return scaled.masked_fill((n > 0).unsqueeze(1) & (scaled < floor), float("-inf"))


def _filtered_sorted(
    logits: torch.Tensor, settings: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits sorted in descending order (equal ones by token id), -inf
    where top-n-sigma, top-k, top-p or min-p drop them, and the ids of each sorted
    position."""
    vocab = logits.shape[-1]
    top_k, top_p, min_p = settings.top_k, settings.top_p, settings.min_p
    scaled = logits / settings.temperature.clamp_min(1e-6).unsqueeze(1)  # a new tensor
    scaled = top_n_sigma(scaled, settings.top_n_sigma)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each candidate
    drop = ((top_p < 1.0).unsqueeze(1) & (before >= top_p.unsqueeze(1))) | (
        probs < min_p.unsqueeze(1) * probs[:, :1]
    )
    drop &= rank > 0  # the most likely candidate always survives
    return sorted_logits.masked_fill(drop, float("-inf")), sorted_ids


def filtered_probs(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """The distribution `sample` draws from, [rows, vocab] float32 (temperature > 0)."""
    sorted_logits, sorted_ids = _filtered_sorted(logits, settings)
    probs = sorted_logits.softmax(dim=-1)
    return torch.zeros_like(probs).scatter_(1, sorted_ids, probs)


def sample_from(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One id per row of `probs` [rows, vocab] (rows need not be normalised), drawn with the
    same counter-based noise as `sample`."""
    noise = seeded_uniform(seeds, counters, probs.shape[-1])
    return (probs.double().log() - torch.log(-torch.log(noise))).argmax(dim=-1)


def top_logprobs(logits: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num_top` most likely tokens' logprobs and ids ([rows, num_top] each; empty,
    computing nothing, when num_top is 0)."""
    if not num_top:
        return logits[:, :0], torch.empty(
            logits.shape[0], 0, dtype=torch.int64, device=logits.device
        )
    return logits.log_softmax(dim=-1).topk(num_top, dim=-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model logprobs (before temperature or filtering) of the sampled ids [rows], their ranks
    among all tokens [rows] (vLLM's: 1 + how many others are at least as likely) and the top
    `num_top` alternatives ([rows, num_top] ids and values)."""
    # One log-softmax kernel: built from torch's log-sum-exp instead (not writing the
    # [rows, vocab] result) it took more kernels, and a 256-row pass on an H200 went from
    # 0.975x to 0.967x of f2999c1's in same-run A/Bs.
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
    top_values, top_ids = (
        logprobs.topk(num_top, dim=-1)
        if num_top
        else (logprobs[:, :0], token_ids.new_empty(token_ids.shape[0], 0))
    )
    return chosen, ranks, top_ids, top_values
