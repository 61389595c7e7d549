"""The trainer backends: the `torch` backend (backend_hf.py, transformers), the `megatron` backend
(backend_megatron.py and its megatron_* parts), what both share (backend_common.py), and what only they
use: packed per-sequence attention, the MoE routing-mismatch metric and rollout routing replay."""
