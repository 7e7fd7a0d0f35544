"""Offline throughput benchmark: see vllm_rlt.bench.throughput (or `vllm-rlt bench throughput`)."""

import sys

from vllm_rlt.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
