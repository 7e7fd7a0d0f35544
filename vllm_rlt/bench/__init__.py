"""Benchmarks shipped with the package so `vllm-rlt bench ...` works from an install."""
