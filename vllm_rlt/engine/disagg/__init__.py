"""Prefill/decode disaggregation: K/V handed from a prefill core to a decode core."""
