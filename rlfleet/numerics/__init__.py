"""Torch numerics shared by sampler emulation, weight views and trainer (low-precision formats, tiny GPT).

Never imported by the operator (import-linter contract)."""
