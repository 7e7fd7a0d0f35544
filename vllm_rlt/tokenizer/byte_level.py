"""Byte-level tokenizer: one id per UTF-8 byte plus three ChatML specials, for tests and toys.

It is an ordinary `tokenizers.Tokenizer`, so it saves to and loads from `tokenizer.json` like
any HF tokenizer and exercises the same code paths as a real model's tokenizer.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256


def _byte_chars() -> list[str]:
    """Byte b -> the ByteLevel alphabet character standing for it (GPT-2's table).

    The library keeps the table private; GPT-2's rule rebuilds it from the public alphabet: a
    byte whose own code point is in the alphabet stands for itself, and the other bytes take the
    remaining characters in code-point order.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    shifted = iter(sorted(char for char in alphabet if ord(char) >= 256))
    return [chr(b) if chr(b) in alphabet else next(shifted) for b in range(256)]


@functools.cache
def byte_values() -> dict[str, int]:
    """The inverse of the ByteLevel table: alphabet character -> the byte it stands for."""
    return {char: b for b, char in enumerate(_byte_chars())}


def build_byte_tokenizer() -> Tokenizer:
    """Build the byte tokenizer: specials at ids 0-2, byte b at id 3 + b, no merges.

    The ByteLevel pre-tokenizer (no prefix space, no regex split) turns every UTF-8 byte into one
    alphabet character, an empty-merge BPE maps each character to its id, and the ByteLevel
    decoder turns ids back into text, with U+FFFD for invalid or incomplete byte sequences.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: BYTE_OFFSET + b for b, char in enumerate(_byte_chars())})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer
