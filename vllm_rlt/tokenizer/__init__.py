"""Tokenization: HF tokenizer files, chat templates, streaming detokenization, byte tokenizer."""

from vllm_rlt.tokenizer.byte_level import build_byte_tokenizer
from vllm_rlt.tokenizer.detokenizer import IncrementalDetokenizer
from vllm_rlt.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "build_byte_tokenizer"]
