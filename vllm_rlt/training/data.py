"""Seeded generators of short checkable problems: `347+589=` -> `936`, then end of text.

Each task has one answer, and its difficulty varies from token to token (a carry makes some
digits harder than others), which gives a trained exit gate something real to decide.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

Problem = tuple[str, str]  # (prompt, answer)


def _add(rng: random.Random) -> Problem:
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    return f"{a}+{b}=", str(a + b)


def _sub(rng: random.Random) -> Problem:
    a, b = sorted((rng.randrange(100, 1000), rng.randrange(100, 1000)), reverse=True)
    return f"{a}-{b}=", str(a - b)


def _mul(rng: random.Random) -> Problem:
    # Four digits, not three: 7,200 distinct three-digit problems were memorised rather
    # than generalised (docs/benchmarks/2026-11-30-training-probe.md).
    a, b = rng.randrange(1000, 10000), rng.randrange(2, 10)
    return f"{a}*{b}=", str(a * b)


def _sort(rng: random.Random) -> Problem:
    digits = [rng.randrange(10) for _ in range(rng.randrange(4, 7))]
    return f"sort {''.join(map(str, digits))}=", "".join(map(str, sorted(digits)))


def _reverse(rng: random.Random) -> Problem:
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randrange(4, 8)))
    return f"rev {word}=", word[::-1]


def _count(rng: random.Random) -> Problem:
    letter = rng.choice("abc")
    text = "".join(rng.choice("abc") for _ in range(rng.randrange(5, 10)))
    return f"count {letter} {text}=", str(text.count(letter))


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "sort": _sort,
    "reverse": _reverse,
    "count": _count,
}

# The prompts each task produces, as patterns: a prompt that matches none lies outside what a
# model trained here has seen, and its answer is likely wrong.
PROMPT_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    "add": (re.compile(r"[1-9]\d\d\+[1-9]\d\d="), "a+b= with a, b in 100..999"),
    "sub": (re.compile(r"([1-9]\d\d)-([1-9]\d\d)="), "a-b= with 100 <= b <= a <= 999"),
    "mul": (re.compile(r"[1-9]\d\d\d\*[2-9]="), "a*b= with a in 1000..9999, b in 2..9"),
    "sort": (re.compile(r"sort \d{4,6}="), "sort DIGITS= with 4 to 6 digits"),
    "reverse": (re.compile(r"rev [a-j]{4,7}="), "rev WORD= with 4 to 7 letters a-j"),
    "count": (re.compile(r"count [abc] [abc]{5,9}="), "count L TEXT= with 5 to 9 letters a-c"),
}


# The trained model knows only bare prompts: chat passes the last user message through.
CHAT_TEMPLATE = (
    "{% for message in messages if message['role'] == 'user' %}"
    "{% if loop.last %}{{ message['content'] }}{% endif %}{% endfor %}"
)


def task_of(prompt: str) -> str | None:
    """The task whose prompts look like `prompt`, or None when no task makes such prompts."""
    for task, (pattern, _) in PROMPT_FORMATS.items():
        match = pattern.fullmatch(prompt)
        if match and (task != "sub" or int(match[1]) >= int(match[2])):
            return task
    return None


# Distinct prompts each task can produce; a training set takes at most 70% of them so a
# disjoint held-out set always exists.
CAPACITY = {
    "add": 900 * 900,
    "sub": 900 * 901 // 2,
    "mul": 9000 * 8,
    "sort": sum(10**n for n in range(4, 7)),
    "reverse": sum(10**n for n in range(4, 8)),
    "count": 3 * sum(3**n for n in range(5, 10)),
}
TRAIN_SEED = 1
EVAL_SEED = 2


def training_set(task: str, size: int) -> list[Problem]:
    return problems(task, min(size, int(CAPACITY[task] * 0.7)), TRAIN_SEED)


def problems(task: str, count: int, seed: int, exclude: set[str] | None = None) -> list[Problem]:
    """`count` distinct problems of one task, never one whose prompt is in `exclude`."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    rng = random.Random(f"{task}:{seed}")
    seen: set[str] = set(exclude or ())
    out: list[Problem] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"task {task!r} cannot supply {count} distinct problems")
        prompt, answer = TASKS[task](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append((prompt, answer))
    return out


def held_out(task: str, count: int, training: list[Problem]) -> list[Problem]:
    """An evaluation set drawn with its own seed and checked against the training prompts."""
    return problems(task, count, EVAL_SEED, exclude={p for p, _ in training})
