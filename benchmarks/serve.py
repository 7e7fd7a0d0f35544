"""Serving benchmark: see vllm_rlt.bench.serve (or `vllm-rlt bench serve`)."""

import sys

from vllm_rlt.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
