"""The one-read sampling kernels on the LM head's own dtype with the min_tokens ban read
beside the logits, against the torch form (which widens and masks a copy first)."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.layers.sampler import TokenBan
from vllm_rlt.ops.torch_ops import TorchOps

pytestmark = pytest.mark.gpu


def _case(rows: int, vocab: int, dtype: torch.dtype):
    """Logits with ties at the top, and a ban on each row's argmax and last token that
    holds for every other row (slots shared by two rows, a table with spare slots)."""
    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits = (6 * torch.randn(rows, vocab, device="cuda", generator=gen)).to(dtype)
    if rows > 2:
        logits[2, [7, vocab - 1]] = logits[2].max() + 1
    slots = torch.randint(0, rows + 3, (rows,), device="cuda", generator=gen)
    table = torch.zeros(rows + 3, vocab, dtype=torch.bool, device="cuda")
    table[slots, logits.float().argmax(1)] = True
    table[slots, vocab - 1] = True
    active = torch.arange(rows, device="cuda") % 2 == 0
    return logits, TokenBan(table, slots, active), gen


@pytest.mark.parametrize("rows", [1, 3, 17, 256, 1100])
@pytest.mark.parametrize("vocab", [300, 2048, 49152, 65537])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("banned", [True, False])
@pytest.mark.parametrize("some_live", [True, False])
def test_token_stats_read_the_heads_dtype_and_the_ban(rows, vocab, dtype, banned, some_live):
    """One run a row or many (kernels/token_stats.py's runs), with rows that sample nothing
    (zeros, their logits unread) beside those that do."""
    from vllm_rlt.ops.triton_ops import TritonOps

    logits, ban, gen = _case(rows, vocab, dtype)
    ban = ban if banned else None
    live = torch.arange(rows, device="cuda") % 3 != 1 if some_live else None
    keep = slice(None) if live is None else live
    want = TorchOps().token_stats(logits, None, ban)
    got = TritonOps().token_stats(logits, None, ban, live)
    assert torch.equal(got[0][keep], want[0][keep])
    torch.testing.assert_close(got[1][keep], want[1][keep], atol=1e-5, rtol=1e-5)
    if live is not None:
        assert not any(result[~live].any() for result in got)
    if ban is not None:  # the banned argmax is never drawn where the ban holds
        assert not ban.table[ban.slots, got[0]][ban.active & (live if some_live else True)].any()
    given = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    given[0] = logits[0].float().argmax()  # banned for row 0: its logprob is -inf
    want = TorchOps().token_stats(logits, given, ban)
    got = TritonOps().token_stats(logits, given, ban, live)
    torch.testing.assert_close(got[1][keep], want[1][keep], atol=1e-5, rtol=1e-5)
    widened = logits.float() if ban is None else ban.apply(logits.float())
    chosen = widened.gather(1, given.unsqueeze(1))
    assert torch.equal(got[2][keep], (widened >= chosen).sum(1)[keep])


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
@pytest.mark.parametrize("vocab", [300, 49152, 65537])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_sampling_reads_the_heads_dtype_and_the_ban(rows, vocab, dtype):
    from vllm_rlt.ops.triton_ops import TritonOps

    logits, ban, gen = _case(rows, vocab, dtype)
    temperature = 2 * torch.rand(rows, device="cuda", generator=gen)
    temperature[rows // 2] = 0.0
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    counters = torch.randint(0, 2**40, (rows,), device="cuda", generator=gen)
    for b in (ban, None):
        got = TritonOps().sample_plain(logits, temperature, seeds, counters, b)
        assert torch.equal(got, TorchOps().sample_plain(logits, temperature, seeds, counters, b))
    got = TritonOps().sample_plain(logits, temperature, seeds, counters, ban)
    assert not ban.table[ban.slots, got][ban.active].any()
