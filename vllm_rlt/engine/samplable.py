"""Whether a request's token constraints leave a token to sample at every step it can reach.

Three settings take tokens away: `allowed_token_ids` (only those), the bad words (a word's
last token wherever the output ends with the rest of it; a one-token word always) and
`min_tokens` (EOS and stop ids until that many tokens are out; after, sampling one ends
the output, so a step left with only those is fine). logit_bias, the penalties and
top-k / top-p / min-p never empty a row: their values are finite and the filters keep the
most likely token. Which tokens the bad words bar depends only on the longest end of the
output that begins some word, so the steps form a small automaton over those ends (at
most 1 + 64 x 7 states); a search from the empty output finds the first step at which
each end can occur, which decides both whether it comes before max_tokens and whether
min_tokens still applies. No path goes on through an EOS or stop id (it ends the output,
or is barred). The check is exact for these settings, so a request it accepts never meets
a step with nothing to sample; a stop string, which could end the output earlier, is not
followed, so a request one would have saved is refused too. The device keeps a fallback
for a row left empty all the same (PenaltyState.adjust)."""

from __future__ import annotations

from collections import deque

from vllm_rlt.config import ParamError
from vllm_rlt.sampling_params import SamplingParams

_SHOWN_IDS = 8


def check_samplable(params: SamplingParams, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
    """ParamError naming the fields when some reachable step would have nothing to sample.
    `params` are in the core's terms (bad words as token ids, each id below vocab_size)."""
    words = {tuple(ids) for ids in params.bad_words_token_ids or ()}
    ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if not words and not (params.min_tokens and ending):
        return
    allowed = set(params.allowed_token_ids) if params.allowed_token_ids else None

    def exhausts(excluded: set[int]) -> bool:
        """Whether `excluded` holds every token the request may sample."""
        if allowed is None:
            return len(excluded) >= vocab_size and excluded >= set(range(vocab_size))
        return allowed <= excluded

    starts = {word[:length] for word in words for length in range(len(word))}
    children: dict[tuple[int, ...], set[int]] = {}
    for start in starts:
        if start:
            children.setdefault(start[:-1], set()).add(start[-1])
    bars: dict[tuple[int, ...], set[int]] = {}
    for word in words:
        bars.setdefault(word[:-1], set()).add(word[-1])
    # A word's first token leads from any end that no longer start continues with it to
    # its one-token end, first reached from the first end that may sample it: later ends
    # need not try it again (with 64 words, trying every one from every end is slow).
    unreached_firsts = set(children.get((), ()))
    first_step = {(): 0}
    queue = deque([()])
    while queue:
        end = queue.popleft()
        step = first_step[end]
        suffixes = [end[cut:] for cut in range(len(end) + 1)]  # the empty one last
        barred = set().union(*(bars.get(suffix, ()) for suffix in suffixes))
        if exhausts(barred) or (step < params.min_tokens and exhausts(barred | ending)):
            raise _refusal(params, end, step, barred, ending, allowed, vocab_size)
        if step + 1 >= params.max_tokens:
            continue
        longer = set().union(*(children.get(suffix, ()) for suffix in suffixes[:-1]))
        usable = longer | unreached_firsts
        usable -= barred | ending
        if allowed is not None:
            usable &= allowed
        nexts = {_longest_start(end + (token,), starts) for token in usable & longer}
        nexts |= {(token,) for token in usable - longer}
        unreached_firsts -= usable - longer
        if not exhausts(barred | ending | longer | children.get((), set())):
            nexts.add(())  # a token that begins no word: back to the empty end
        for following in nexts - first_step.keys():
            first_step[following] = step + 1
            queue.append(following)


def _longest_start(sequence: tuple[int, ...], starts: set[tuple[int, ...]]) -> tuple[int, ...]:
    return next(sequence[cut:] for cut in range(len(sequence) + 1) if sequence[cut:] in starts)


def _refusal(
    params: SamplingParams,
    end: tuple[int, ...],
    step: int,
    barred: set[int],
    ending: set[int],
    allowed: set[int] | None,
    vocab_size: int,
) -> ParamError:
    pool = range(vocab_size) if allowed is None else allowed
    barred_here = {token for token in barred if token in pool}
    reasons = [f"bad_words bar {_ids(barred_here)}"] if barred_here else []
    if len(barred_here) < len(pool):
        rest = {token for token in ending if token in pool} - barred_here
        reasons.append(
            f"min_tokens ({params.min_tokens}) bans the EOS and stop token ids {_ids(rest)} "
            "until that many tokens are out"
        )
    tokens = "1 token" if step == 1 else f"{step} tokens"
    where = (
        "at the first token"
        if not end
        else f"after {tokens}, once the output ends with the tokens {list(end)}"
    )
    of = "the vocabulary" if allowed is None else f"allowed_token_ids {_ids(allowed)}"
    message = f"nothing could be sampled {where}: of {of}, {' and '.join(reasons)}"
    if allowed is not None:
        return ParamError(message, "allowed_token_ids")
    return ParamError(message, "bad_words" if barred_here else "min_tokens")


def _ids(tokens: set[int]) -> str:
    shown = sorted(tokens)
    more = f", ... ({len(shown)} in all)" if len(shown) > _SHOWN_IDS else ""
    return "[" + ", ".join(map(str, shown[:_SHOWN_IDS])) + more + "]"
