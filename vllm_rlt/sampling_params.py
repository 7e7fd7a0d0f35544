"""SamplingParams: per-request sampling, stopping and loop-depth controls."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_rlt.beam_search import BeamSearchParams  # noqa: F401 (vLLM's import path)
from vllm_rlt.config import (
    ParamError,
    require,
    require_int,
    require_printable_ints,
    require_valid_text,
    shown_int,
)
from vllm_rlt.token_ids import check_logit_bias_keys, check_token_ids, token_range

MAX_LOGPROBS = 20
MAX_N = 128
MAX_TOP_K = 2**31 - 1  # any k at or above the vocabulary size keeps every token
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**31 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # frequency and presence, either sign (OpenAI's range)
MAX_LOGIT_BIAS = 100.0
MAX_TOP_N_SIGMA = 100.0  # either sign; <= 0 is off
MAX_STOP_STRINGS = 64
# The smallest repetition penalty: float32 logits divided by it stay finite (a penalty below
# float32's range, 1e-45, became 0 there and every seen token inf, ties broken by id).
MIN_REPETITION_PENALTY = 1e-30
MAX_BAD_WORDS = 32  # words; each becomes up to two token sequences (with a leading space)
MAX_BAD_WORD_TOKENS = 8  # per token sequence: each form of a word


@dataclass(frozen=True)
class FieldBound:
    """A numeric sampling field: its type, allowed range, default and what it does. The
    checks of `SamplingParams`, the fields of the HTTP request bodies and the flags of
    `vllm-rlt generate` are all made from these."""

    kind: type[int] | type[float]
    low: int | float
    high: int | float | str | None  # None: unbounded above; a name: that field's value
    default: int | float | None
    help: str
    low_open: bool = False  # `low` itself is refused
    optional: bool = False  # None is allowed (as it is whenever the default is None)
    http: bool = True  # a field of every HTTP request body (else each endpoint spells it)
    flag: str | None = None  # `vllm-rlt generate`'s flag, where not --the-name
    cli: bool = True  # `vllm-rlt generate` has a flag for it
    # how the messages state the range, where the interval [low, high] says it badly
    shown_range: str | None = None

    @property
    def nullable(self) -> bool:
        return self.optional or self.default is None


FIELD_BOUNDS: dict[str, FieldBound] = {
    "n": FieldBound(int, 1, MAX_N, 1, "completions per prompt", cli=False),
    "max_tokens": FieldBound(
        int, 1, None, 16, "tokens to generate at most", optional=True, http=False
    ),
    "min_tokens": FieldBound(int, 0, "max_tokens", 0, "no EOS or stop before this"),
    "temperature": FieldBound(float, 0.0, 100.0, 1.0, "0 = greedy"),
    "top_k": FieldBound(
        int,
        -1,
        MAX_TOP_K,
        0,
        "0 or -1 = every token",
        shown_range=f"0 or -1 (every token) or in [1, {MAX_TOP_K}]",
    ),
    "top_p": FieldBound(float, 0, 1, 1.0, "nucleus mass", low_open=True),
    "min_p": FieldBound(float, 0.0, 1.0, 0.0, "relative to the top token"),
    "top_n_sigma": FieldBound(
        float,
        -MAX_TOP_N_SIGMA,
        MAX_TOP_N_SIGMA,
        0.0,
        "keep tokens whose logit (after temperature) is within this many standard "
        "deviations of the top one; <= 0: off",
        optional=True,
    ),
    "seed": FieldBound(  # vLLM's range, a torch int64; negative seeds are taken mod 2**63
        int,
        -MAX_SEED - 1,
        MAX_SEED,
        None,
        "per-request seed (default: random)",
        flag="--sampling-seed",
    ),
    "priority": FieldBound(
        int,
        -MAX_PRIORITY,
        MAX_PRIORITY,
        0,
        "every prompt's priority (lower runs first; needs --scheduling-policy priority)",
    ),
    "repetition_penalty": FieldBound(
        float,
        MIN_REPETITION_PENALTY,
        MAX_REPETITION_PENALTY,
        1.0,
        "divide positive logits (multiply negative ones) of prompt and output tokens",
    ),
    "frequency_penalty": FieldBound(
        float, -MAX_PENALTY, MAX_PENALTY, 0.0, "subtract per output occurrence"
    ),
    "presence_penalty": FieldBound(
        float, -MAX_PENALTY, MAX_PENALTY, 0.0, "subtract once a token was output"
    ),
    "logprobs": FieldBound(
        int,
        0,
        MAX_LOGPROBS,
        None,
        "each generated token's logprob and this many top alternatives (with --json; "
        "default: none)",
        http=False,
    ),
    "prompt_logprobs": FieldBound(
        int,
        0,
        MAX_LOGPROBS,
        None,
        "each prompt token's logprob (from the final loop) and this many top "
        "alternatives (with --json; default: none)",
    ),
    "min_loops": FieldBound(int, 1, None, None, "fewest loops a token runs (default: 1)"),
    "max_loops": FieldBound(
        int, 1, None, None, "most loops a token runs (default: the model's depth)"
    ),
    "exit_threshold": FieldBound(
        float,
        0.0,
        1.0,
        None,
        "Ouro's gate: exit once the exit CDF reaches it (1 = fixed depth); Huginn's "
        "criteria: exit once the change falls below it (0 = fixed depth) (default: the model's)",
    ),
}


def _default(name: str) -> Any:
    return FIELD_BOUNDS[name].default


def check_field(name: str, value: Any, cap: int | float | None = None) -> None:
    """ParamError naming the field and its range unless `value` is one FIELD_BOUNDS allows;
    `cap` is the upper bound of a field bounded by another one's value."""
    bound = FIELD_BOUNDS[name]
    if value is None and bound.nullable:
        return
    high = cap if isinstance(bound.high, str) else bound.high
    if bound.shown_range is not None:
        require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{name} must be an integer: {bound.shown_range}, got {value!r}",
            name,
        )
        in_range = bound.low <= value and (high is None or value <= high)
        if not in_range:  # the message only on failure: every request passes here
            raise ParamError(f"{name} must be {bound.shown_range}, got {shown_int(value)}", name)
    elif bound.kind is int:
        require_int(value, name, int(bound.low), None if high is None else int(high))
    else:
        top = float("inf" if high is None else high)
        _require_float(value, name, float(bound.low), top, low_open=bound.low_open)


# Fields whose entries (or keys) are token ids.
TOKEN_ID_FIELDS = ("stop_token_ids", "allowed_token_ids", "bad_words_token_ids", "logit_bias")


def _allowed(name: str) -> str | None:
    """What a field holds, as its range messages say it (None: no bound to state)."""
    if name in TOKEN_ID_FIELDS:
        return f"a token id in {token_range(None)}"
    if name == "best_of":
        return "None or equal to n"
    bound = FIELD_BOUNDS.get(name)
    if bound is None:
        return None
    if bound.shown_range is not None:
        return bound.shown_range
    if bound.kind is float:
        return f"in {_float_range(bound.low, bound.high, bound.low_open)}"
    return f">= {bound.low}" if bound.high is None else f"in [{bound.low}, {bound.high}]"


def _float_range(low: float, high: float | None, low_open: bool = False) -> str:
    """A float field's range as its messages write it: "(0.0, 1.0]", "[0.0, inf)"."""
    return f"{'(' if low_open else '['}{low}, {'inf)' if high is None else f'{high}]'}"


class RequestOutputKind(enum.IntEnum):
    """What each output of a streamed request holds (vLLM's names): everything so far, what
    is new since the previous one, or only the final output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """What to sample and when to stop, plus the looped-model depth controls.

    `temperature=0` is greedy. `seed` makes a sampled request reproducible whatever else is in
    the batch. `logprobs=N` returns the sampled token's logprob and the top N alternatives.
    `prompt_logprobs=N` returns, for every prompt position after the first, the prompt
    token's logprob and the top N alternatives (prompt positions run every loop, so they come
    from the final loop's LM head); such a request computes its whole prompt, without prefix
    cache hits.
    `min_loops` / `max_loops` bound each decode token's exit depth (None: 1 and the model's
    depth); `exit_threshold` is the exit policy's threshold q (1.0 = always run max_loops).
    `stop` holds at most 64 strings (each is searched for after every token);
    `include_stop_str_in_output` keeps the stop string that ended the text at its end.
    `priority` orders requests under the "priority" scheduling policy: lower runs first, and
    running requests of a higher value are preempted for it.

    vLLM's logit adjustments, applied in this order before temperature and filtering (the
    reported logprobs are the model's, before them): `logit_bias` adds a value per token id;
    `allowed_token_ids` (vLLM's name) lets only those tokens be sampled; `bad_words`
    (vLLM's) are never generated: a word's last token is barred wherever the output so far
    ends with the rest of it (each word is tokenized without a leading space and with one,
    the second form kept unless it ends with the first, each form at most 8 tokens; the
    frontend fills `bad_words_token_ids` with those sequences, which may also be given
    directly). A request whose allowed_token_ids, bad words and min_tokens (which bans EOS
    and stop ids until it is reached) could leave a step with nothing to sample is refused
    before it is queued (engine/samplable.py);
    `repetition_penalty` divides a positive logit (multiplies a negative one) of every token
    seen in the prompt or the output; `frequency_penalty` subtracts per occurrence in the
    output and `presence_penalty` once for any. `skip_special_tokens` leaves special tokens
    out of the text; `spaces_between_special_tokens` (when they are kept) separates them from
    the text around them with a space. `output_kind` says what each output of a streamed
    request (`AsyncLLM.generate`) holds; `LLM` returns final outputs whatever it says.

    As in vLLM: `max_tokens=None` generates up to the context (max_model_len, or the KV
    cache's capacity where smaller, minus the prompt); `top_k` 0 or -1 keeps every token;
    `top_n_sigma=n` keeps the tokens whose logit, after temperature, is within n standard
    deviations of the row's largest (None or <= 0: off);
    `truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: the context length,
    at most max_model_len). `best_of` (dropped by vLLM V1) must be None or n, and
    `logits_processors` must be empty; any other name is a ValueError naming it.
    """

    n: int = _default("n")
    max_tokens: int | None = _default("max_tokens")
    min_tokens: int = _default("min_tokens")
    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    min_p: float = _default("min_p")
    seed: int | None = _default("seed")
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = _default("logprobs")
    prompt_logprobs: int | None = _default("prompt_logprobs")
    min_loops: int | None = _default("min_loops")
    max_loops: int | None = _default("max_loops")
    exit_threshold: float | None = _default("exit_threshold")
    include_stop_str_in_output: bool = False
    priority: int = _default("priority")
    repetition_penalty: float = _default("repetition_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    presence_penalty: float = _default("presence_penalty")
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    top_n_sigma: float | None = _default("top_n_sigma")  # last: positional calls keep their fields

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        """An unknown name is a ParamError naming it, not a bare TypeError."""
        for name in kwargs:
            if name not in _INIT_NAMES:
                raise ParamError(
                    f"SamplingParams() got the argument {name!r}, which this engine does not "
                    "support; help(vllm_rlt.SamplingParams) lists the fields it takes",
                    name,
                )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name, allowed in _ALLOWED.items():  # first: the checks below print what they refuse
            value = getattr(self, name)
            if isinstance(value, (int, list, tuple, dict)):  # what can hold an integer
                require_printable_ints(name, value, allowed, values_allowed=_BIAS_RANGE)
        require(
            self.best_of is None or self.best_of == self.n,
            "best_of is not supported (vLLM V1 dropped it): leave it unset (None; null over "
            f"HTTP) or equal to n ({self.n}), got {self.best_of!r}",
            "best_of",
        )
        self.best_of = None
        require(
            not self.logits_processors,
            "logits_processors are not supported (Python callables cannot run in the "
            "engine's sampling on the device); logit_bias, allowed_token_ids and bad_words "
            "cover the common uses",
            "logits_processors",
        )
        self.logits_processors = None
        kinds = [kind.value for kind in RequestOutputKind]
        require(
            not isinstance(self.output_kind, bool) and self.output_kind in kinds,
            f"output_kind must be one of {kinds} (RequestOutputKind), got {self.output_kind!r}",
            "output_kind",
        )
        self.output_kind = RequestOutputKind(self.output_kind)
        for name, bound in FIELD_BOUNDS.items():
            cap = getattr(self, bound.high) if isinstance(bound.high, str) else None
            check_field(name, getattr(self, name), cap)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_n_sigma is None:
            self.top_n_sigma = 0.0
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            require_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", 1)
        if self.logit_bias is not None:
            require(
                isinstance(self.logit_bias, dict),
                f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                "logit_bias",
            )
            check_logit_bias_keys(list(self.logit_bias))
            for key, value in self.logit_bias.items():
                _require_float(
                    value, f"logit_bias[{key}]", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "logit_bias"
                )
        if self.allowed_token_ids is not None:
            require(
                isinstance(self.allowed_token_ids, (list, tuple)) and self.allowed_token_ids,
                "allowed_token_ids must be a non-empty list of token ids, got "
                f"{self.allowed_token_ids!r}",
                "allowed_token_ids",
            )
            self.allowed_token_ids = list(self.allowed_token_ids)
            check_token_ids("allowed_token_ids", self.allowed_token_ids)
        self._check_bad_words()
        for flag in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            value = getattr(self, flag)
            require(isinstance(value, bool), f"{flag} must be true or false, got {value!r}", flag)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        require(
            self.stop is None or isinstance(self.stop, (list, tuple)),
            f"stop must be a string or a list of strings, got {self.stop!r}",
            "stop",
        )
        self.stop = list(self.stop or [])
        require(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
            "stop",
        )
        for text in self.stop:
            require(
                isinstance(text, str) and text != "",
                f"stop must hold non-empty strings, got {text!r}",
                "stop",
            )
            require_valid_text(text, "stop")
        require(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
            f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
            "stop_token_ids",
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.min_loops is not None and self.max_loops is not None:
            require(
                self.min_loops <= self.max_loops,
                f"min_loops ({self.min_loops}) must be <= max_loops ({self.max_loops})",
                "min_loops",
            )

    def _check_bad_words(self) -> None:
        if self.bad_words is not None:
            words = self.bad_words
            require(
                isinstance(words, (list, tuple)) and 0 < len(words) <= MAX_BAD_WORDS,
                f"bad_words must be a list of 1 to {MAX_BAD_WORDS} strings, got {words!r}",
                "bad_words",
            )
            self.bad_words = list(words)
            for word in self.bad_words:
                require(
                    isinstance(word, str) and word.strip() != "",
                    f"bad_words must hold non-blank strings, got {word!r}",
                    "bad_words",
                )
                require_valid_text(word, "bad_words")
        if self.bad_words_token_ids is not None:
            sequences = self.bad_words_token_ids
            require(
                isinstance(sequences, (list, tuple)) and len(sequences) <= 2 * MAX_BAD_WORDS,
                f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} token-id "
                f"lists, got {sequences!r}",
                "bad_words_token_ids",
            )
            for ids in sequences:
                require(
                    isinstance(ids, (list, tuple)),
                    f"bad_words_token_ids must hold token-id lists, got {ids!r}",
                    "bad_words",
                )
            self.bad_words_token_ids = [list(ids) for ids in sequences]
            for index, ids in enumerate(self.bad_words_token_ids):
                require(
                    0 < len(ids) <= MAX_BAD_WORD_TOKENS,
                    f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(ids)}",
                    "bad_words",
                )
                check_token_ids(f"bad_words_token_ids[{index}]", ids, param="bad_words")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Any of logit_bias, allowed_token_ids, bad words and the three penalties is on."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.bad_words_token_ids
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )

    def resolved_loops(self, total_loops: int) -> tuple[int, int]:
        """(min_loops, max_loops) with defaults filled in, checked against the model depth."""
        max_loops = total_loops if self.max_loops is None else self.max_loops
        min_loops = 1 if self.min_loops is None else self.min_loops
        require_int(max_loops, "max_loops", 1, total_loops)
        require_int(min_loops, "min_loops", 1, max_loops)
        return min_loops, max_loops


_INIT_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _require_float(
    value: object,
    name: str,
    low: float,
    high: float,
    param: str | None = None,
    low_open: bool = False,
) -> None:
    """ParamError unless `value` is a number in the range; `name` in the message (an entry:
    "logit_bias[5]"), `param` the field (default: `name`)."""
    shown, param = _float_range(low, high, low_open), param or name
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        f"{name} must be a number in {shown}, got {value!r}",
        param,
    )
    within = (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not within:
        got = shown_int(value) if isinstance(value, int) else value
        raise ParamError(f"{name} must be in {shown}, got {got}", param)


# What each field may hold and logit_bias's values, for the too-long-integer check: worked
# out once, not for every request.
_ALLOWED = {each.name: _allowed(each.name) for each in fields(SamplingParams)}
_BIAS_RANGE = f"in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
