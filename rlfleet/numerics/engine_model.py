"""The reference sampler engine's Qwen3 implementation: the model a CPU "sampler" computes with.

Like SGLang, the engine does not run transformers' modeling code: it has its own implementation of
the architecture (here `EngineModel`, SGLang's is `srt/models/qwen3.py`) with its own kernels and KV
cache, loaded from the same Hugging Face checkpoint (config.json + safetensors, Hugging Face
parameter names) the trainer trains with transformers' `Qwen3ForCausalLM`. tests/sampler/
test_sampler_engine_model.py holds it against transformers: logits equal to 1e-5 with the exact
kernel, with and without the slot cache, for QK-norm, grouped-query attention, a custom head_dim,
tied embeddings and both rope config forms, and Qwen3-MoE (the same logits and the same routed experts
as transformers' `Qwen3MoeForCausalLM`).

Architecture (Qwen3 dense, `model_type` "qwen3"): RMSNorm pre-norm, q/k/v/o projections without bias,
per-head RMSNorm on q and k before rotary positions (QK-norm), grouped-query attention, SwiGLU MLP
(Qwen3-MoE, "qwen3_moe": every layer's MLP is routed experts, top-k of a router's softmax, no shared
expert; `routed_experts` holds the last forward's choices),
lm_head (or the embedding, when `tie_word_embeddings`).

Two paths:
- `forward(input_ids [B, S]) -> logits float32 [B, S, V]`, causal, no cache;
- `forward(input_ids [B, S], cache=KVCache, rows=LongTensor[B])`: appends S tokens to the given rows of
  a preallocated slot cache (rows may have different lengths: the sampler's batched decode) and
  returns logits for those S tokens.

The sampler-side knobs live on the module, not in the weights: `kernel` (activation/accumulation
dtype and split-K reduction order, so even bf16-vs-bf16 differs slightly, as real kernels do) and the
cache's `kv_dtype` (fp8_e4m3 round-trips K and V through E4M3 on write, like SGLang's fp8 KV cache with
scale 1.0; auto is the model dtype, as in SGLang: bf16 with a bf16 kernel, float32 with the exact one). `precision_view` gives the weights a group of a weight format really computes with.

LoRA (docs/sampler.md, "LoRA"): `forward(..., adapters=[LoraAdapter | None per batch row])` adds each row's
adapter to the projections it targets, y = W_q x + (alpha / r) B (A x), on the emulated quantized base W_q,
with A and B in bf16 (SGLang keeps adapters in the model dtype); a batch may mix adapters and rows
without one. `read_lora_adapter` reads PEFT's adapter directory (adapter_config.json +
adapter_model.safetensors).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlfleet.numerics.formats import fake_quantize_fp8_e4m3

KV_DTYPES = ("auto", "bf16", "fp8_e4m3")  # what `EngineModel.new_cache` takes (SGLang's names)
KV_STORAGE = ("float32", "bf16", "fp8_e4m3")  # what a KVCache rounds K and V to ("auto" resolved)
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the reference engine implements."""


@dataclass(frozen=True)
class ModelShape:
    """The architecture part of a Qwen3 config.json (what the engine needs to compute)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int = 0
    """0: dense (every layer's MLP is one SwiGLU); > 0: Qwen3-MoE, every layer's MLP is `num_experts`
    routed SwiGLU experts of `moe_intermediate_size`, each token using the top `num_experts_per_tok`."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_experts and not (
            1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"a mixture of experts needs 1 <= num_experts_per_tok <= num_experts ({self.num_experts}) and "
                f"moe_intermediate_size > 0, got {self.num_experts_per_tok} and {self.moe_intermediate_size}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """A Qwen3 config.json (transformers 4: `rope_theta`; transformers 5: `rope_parameters`)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"the reference sampler engine implements {', '.join(SUPPORTED_MODEL_TYPES)}; the checkpoint "
                f"is model_type {model_type!r}: serve it with SGLang (--engine sglang)"
            )
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise UnsupportedModelError(
                f"rope scaling {rope or config.get('rope_scaling')} is not implemented"
            )
        if config.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not implemented")
        if config.get("attention_bias"):  # the engine's q/k/v/o projections have no bias
            raise UnsupportedModelError("attention_bias (biased q/k/v/o projections) is not implemented")
        if config.get("hidden_act", "silu") != "silu":  # the MLP is SwiGLU: silu(gate) * up
            raise UnsupportedModelError(
                f"hidden_act {config.get('hidden_act')!r} is not implemented (only silu)"
            )
        heads = int(config["num_attention_heads"])
        return cls(
            **_moe_fields(config) if model_type == "qwen3_moe" else {},
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ModelShape:
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{directory}: no config.json (not a Hugging Face checkpoint)")
        return cls.from_hf_config(json.loads(path.read_text()))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields (transformers 5 writes num_experts as num_local_experts); only
    every-layer-sparse models (no shared expert in Qwen3-MoE)."""
    if int(config.get("decoder_sparse_step", 1)) != 1 or config.get("mlp_only_layers"):
        raise UnsupportedModelError(
            "a Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not implemented"
        )
    return {
        "num_experts": int(config.get("num_experts") or config["num_local_experts"]),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
    }


@dataclass
class KernelConfig:
    """How the linear layers compute (sampler-side emulation of kernel differences).

    act_dtype: "float32" (exact reference) or "bfloat16" (inputs and weights rounded to bf16, fp32
    accumulate, output rounded to bf16, like a bf16 GEMM). split_k > 1 splits the reduction dim into
    chunks whose partial sums are rounded to act_dtype and added in order (a different reduction order).
    """

    act_dtype: str = "float32"
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.act_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"act_dtype must be float32 or bfloat16, got {self.act_dtype!r}")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")

    @property
    def is_exact(self) -> bool:
        return self.act_dtype == "float32" and self.split_k == 1


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LORA_WEIGHT_PREFIX = "base_model.model."
"""PEFT's prefix of an adapter's tensor names (`base_model.model.<module>.lora_A.weight`)."""


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, the scheduler's per-batch adapter set
class LoraAdapter:
    """A PEFT LoRA adapter as an engine applies it: per projection (its HF module name, e.g.
    `model.layers.0.self_attn.q_proj`), A [r, in] and B [out, r] as float32 tensors holding bf16 values
    (SGLang keeps adapters in the model dtype), scaled by alpha / r (SGLang's LoRAAdapter.scaling)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


_Lora = Sequence[tuple[LoraAdapter, torch.Tensor]]
"""A forward's adapters: (adapter, the batch rows that use it), rows without one left out."""


def _row_groups(adapters: Sequence[LoraAdapter | None] | None, bsz: int) -> _Lora:
    if adapters is None:
        return ()
    if len(adapters) != bsz:
        raise ValueError(f"{len(adapters)} adapters for a batch of {bsz} rows")
    rows: dict[LoraAdapter, list[int]] = {}
    for b, adapter in enumerate(adapters):
        if adapter is not None:
            rows.setdefault(adapter, []).append(b)
    return [(adapter, torch.tensor(idx)) for adapter, idx in rows.items()]


def lora_modules(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target on `shape`: HF module name -> (in, out) features. A mixture
    of experts' experts are not among them (rlfleet/api/lora_spec.py: the trainer refuses them)."""
    h, q, kv, i = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size
    out: dict[str, tuple[int, int]] = {}
    for li in range(shape.num_hidden_layers):
        at = f"model.layers.{li}.self_attn."
        out |= {at + "q_proj": (h, q), at + "k_proj": (h, kv), at + "v_proj": (h, kv), at + "o_proj": (q, h)}
        if not shape.is_moe:
            mlp = f"model.layers.{li}.mlp."
            out |= {mlp + "gate_proj": (h, i), mlp + "up_proj": (h, i), mlp + "down_proj": (i, h)}
    return out


def lora_adapter(
    config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], shape: ModelShape
) -> LoraAdapter:
    """PEFT's adapter_config.json and adapter_model.safetensors tensors -> the adapter of `shape`. Every
    tensor must be the lora_A / lora_B of a projection the model has and the config targets, in the
    config's rank (what SGLang reads; a tensor it would silently drop is refused here)."""
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"not a LoRA adapter: peft_type {config.get('peft_type')!r}")
    if config.get("use_rslora") or config.get("use_dora"):  # SGLang 0.5.23 scales by alpha / r only
        raise ValueError("rsLoRA and DoRA adapters are not served (SGLang scales every adapter by alpha / r)")
    rank, alpha, targets = int(config["r"]), float(config["lora_alpha"]), config["target_modules"]
    if not isinstance(targets, list):
        raise ValueError(f"target_modules must be a list of module names, got {targets!r}")
    known, parts = lora_modules(shape), {}
    for name, t in tensors.items():
        module, _, part = name.removeprefix(LORA_WEIGHT_PREFIX).rpartition(".lora_")
        if (
            not name.startswith(LORA_WEIGHT_PREFIX)
            or module not in known
            or part not in ("A.weight", "B.weight")
        ):
            raise ValueError(f"adapter tensor {name}: not the LoRA A/B of a projection of this model")
        if module.rpartition(".")[2] not in targets:
            raise ValueError(f"adapter tensor {name}: its module is not in target_modules {targets}")
        fan_in, fan_out = known[module]
        want = (rank, fan_in) if part == "A.weight" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"adapter tensor {name}: shape {tuple(t.shape)} != {want} (rank {rank})")
        parts[name] = t.detach().to(torch.bfloat16).float()
    weights = {}
    for module in {n.removeprefix(LORA_WEIGHT_PREFIX).rpartition(".lora_")[0] for n in parts}:
        a, b = (parts.get(f"{LORA_WEIGHT_PREFIX}{module}.lora_{x}.weight") for x in "AB")
        if a is None or b is None:
            raise ValueError(f"adapter module {module}: lora_A and lora_B come in pairs")
        weights[module] = (a, b)
    return LoraAdapter(rank, alpha, tuple(targets), weights)


def read_lora_adapter(directory: str | Path, shape: ModelShape) -> LoraAdapter:
    """The adapter in a PEFT adapter directory (rlfleet/lora.py's files) for a model of `shape`."""
    from safetensors.torch import load_file

    from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

    config = json.loads((Path(directory) / ADAPTER_CONFIG_FILE).read_text())
    return lora_adapter(config, load_file(str(Path(directory) / ADAPTER_WEIGHTS_FILE)), shape)


class KVCache:
    """Preallocated slot cache: per layer K and V [slots, kv_heads, capacity, head_dim] (float32 storage;
    fp8_e4m3 values are rounded through E4M3 on write, bf16 through bf16) and lengths [slots]."""

    def __init__(self, shape: ModelShape, slots: int, capacity: int | None = None, kv_dtype: str = "float32"):
        if kv_dtype not in KV_STORAGE:
            raise ValueError(f"kv_dtype must be one of {KV_STORAGE}, got {kv_dtype!r}")
        self.capacity = capacity or shape.max_position_embeddings
        self.kv_dtype = kv_dtype
        dims = (slots, shape.num_key_value_heads, self.capacity, shape.head_dim)
        self.k = [torch.zeros(dims) for _ in range(shape.num_hidden_layers)]
        self.v = [torch.zeros(dims) for _ in range(shape.num_hidden_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long)

    @property
    def slots(self) -> int:
        return int(self.lengths.shape[0])

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """The value the cache really holds for x (precision of the KV dtype)."""
        if self.kv_dtype == "fp8_e4m3":
            return fake_quantize_fp8_e4m3(x)
        if self.kv_dtype == "bf16":
            return x.to(torch.bfloat16).float()
        return x

    def reset(self, rows: torch.Tensor | list[int]) -> None:
        self.lengths[torch.as_tensor(rows, dtype=torch.long)] = 0


def _rope_tables(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, D] for positions [B, S] (computed once per forward, shared by the layers);
    the inverse frequencies as transformers' default rope computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    ang = positions.float()[..., None] * inv_freq  # [B, S, D/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None]  # [B, 1, S, D]
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention). x [B, H, S, D]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm in fp32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Norm(nn.Module):
    """A module holding one RMSNorm weight (the engine applies it with `_rms_norm`)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.q_proj = nn.Linear(s.hidden_size, s.q_size, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.kv_size, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.kv_size, bias=False)
        self.o_proj = nn.Linear(s.q_size, s.hidden_size, bias=False)
        self.q_norm = _Norm(s.head_dim)
        self.k_norm = _Norm(s.head_dim)


class _MLP(nn.Module):
    """A SwiGLU MLP: a dense layer's (intermediate_size) or one expert's (moe_intermediate_size)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class _SparseMoe(nn.Module):
    """Qwen3-MoE's MLP: the router (`gate`, num_experts x hidden) and the experts, named as in the HF
    checkpoint (`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`)."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.experts = nn.ModuleList(
            _MLP(s.hidden_size, s.moe_intermediate_size) for _ in range(s.num_experts)
        )


class _Layer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp: nn.Module = _SparseMoe(s) if s.is_moe else _MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = _Norm(s.hidden_size)
        self.post_attention_layernorm = _Norm(s.hidden_size)


class _Backbone(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.num_hidden_layers))
        self.norm = _Norm(s.hidden_size)


class EngineModel(nn.Module):
    """Qwen3 for the reference engine; parameters named as in the HF checkpoint (a tied checkpoint has
    no `lm_head.weight`: the embedding is the output projection)."""

    def __init__(self, shape: ModelShape, kernel: KernelConfig | None = None):
        super().__init__()
        self.shape = shape
        self.kernel = kernel or KernelConfig()
        self.model = _Backbone(shape)
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.requires_grad_(False)
        self.routed_experts: torch.Tensor | None = None
        """A mixture of experts: after each forward, int64 [B, S, layers, top_k], the experts every new
        token was routed to in each layer (SGLang's `return_routed_experts` capture); None for dense."""

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.shape.tie_word_embeddings else self.lm_head.weight

    # ------------------------------------------------------------------------------- kernels
    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        if k.is_exact:
            return F.linear(x, w)
        dt = torch.bfloat16 if k.act_dtype == "bfloat16" else torch.float32
        xq, wq = x.to(dt), w.to(dt)
        if k.split_k == 1:
            # inputs rounded to dt, fp32 accumulation, output rounded to dt: what a bf16 GEMM does, and
            # ~10x faster on CPUs without native bf16 matmul than F.linear on bf16 tensors
            return F.linear(xq.float(), wq.float()).to(dt).float()
        n = x.shape[-1]
        bounds = [(i * n) // k.split_k for i in range(k.split_k + 1)]  # contiguous chunks (slices, no copies)

        def partial_sum(lo: int, hi: int) -> torch.Tensor:
            return F.linear(xq[..., lo:hi].float(), wq[:, lo:hi].float()).to(dt)

        acc = partial_sum(bounds[0], bounds[1])
        for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True):  # partial sums rounded, added in order
            acc = acc + partial_sum(lo, hi)
        return acc.float()

    # ------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
        adapters: Sequence[LoraAdapter | None] | None = None,
    ) -> torch.Tensor:
        """input_ids LongTensor [B, S] -> logits float32 [B, S, V].

        With `cache`, the S new tokens of batch row b are appended to cache slot rows[b] (default
        rows = 0..B-1) after its cached tokens, attention covers that slot's cache, and the slot
        lengths advance by S. `adapters[b]`: batch row b's LoRA adapter (None: the base alone)."""
        s = self.shape
        lora = _row_groups(adapters, input_ids.shape[0])
        bsz, seq = input_ids.shape
        rows = torch.arange(bsz) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        if cache is None:
            positions = torch.arange(seq).expand(bsz, seq)
            start = torch.zeros(bsz, dtype=torch.long)
        else:
            start = cache.lengths[rows]  # [B]
            if int(start.max()) + seq > cache.capacity:
                raise ValueError(f"KV cache capacity {cache.capacity} exceeded")
            positions = start[:, None] + torch.arange(seq)  # [B, S]
        if int(positions.max()) >= s.max_position_embeddings:
            raise ValueError(f"sequence longer than max_position_embeddings {s.max_position_embeddings}")

        eps = s.rms_norm_eps
        routed: list[torch.Tensor] = []  # per MoE layer, [B, S, top_k]
        h = self.model.embed_tokens(input_ids).float()  # [B, S, D]
        cos, sin = _rope_tables(positions, s.head_dim, s.rope_theta)
        for li, layer in enumerate(self.model.layers):
            assert isinstance(layer, _Layer)  # nn.ModuleList yields nn.Module
            x = _rms_norm(h, layer.input_layernorm.weight, eps)
            att, at = layer.self_attn, f"model.layers.{li}.self_attn."
            q = self._project(x, att.q_proj.weight, at + "q_proj", lora)
            k = self._project(x, att.k_proj.weight, at + "k_proj", lora)
            v = self._project(x, att.v_proj.weight, at + "v_proj", lora)
            q = q.view(bsz, seq, s.num_attention_heads, s.head_dim)
            k = k.view(bsz, seq, s.num_key_value_heads, s.head_dim)
            v = v.view(bsz, seq, s.num_key_value_heads, s.head_dim)
            q = _rope(_rms_norm(q, att.q_norm.weight, eps).transpose(1, 2), cos, sin)  # [B, H, S, Dh]
            k = _rope(_rms_norm(k, att.k_norm.weight, eps).transpose(1, 2), cos, sin)  # [B, KVH, S, Dh]
            v = v.transpose(1, 2)
            if cache is None:
                o = self._attention(q, k, v, None)
            else:
                o = self._cached_attention(q, k, v, cache, li, rows, start, positions)
            o = o.transpose(1, 2).reshape(bsz, seq, s.q_size)
            h = h + self._project(o, att.o_proj.weight, at + "o_proj", lora)
            x = _rms_norm(h, layer.post_attention_layernorm.weight, eps)
            if isinstance(layer.mlp, _SparseMoe):
                out, chosen = self._sparse_moe(x, layer.mlp)
                routed.append(chosen)
                h = h + out
            else:
                assert isinstance(layer.mlp, _MLP)
                h = h + self._swiglu(x, layer.mlp, f"model.layers.{li}.mlp.", lora)
        if cache is not None:
            cache.lengths[rows] += seq
        self.routed_experts = torch.stack(routed, dim=2) if routed else None
        return self._linear(_rms_norm(h, self.model.norm.weight, eps), self.output_weight).float()

    def _swiglu(self, x: torch.Tensor, mlp: _MLP, at: str = "", lora: _Lora = ()) -> torch.Tensor:
        """SwiGLU; `at` + module name is a projection's LoRA key (a MoE's experts get none: "")."""
        gate = self._project(x, mlp.gate_proj.weight, at + "gate_proj", lora)
        gated = F.silu(gate) * self._project(x, mlp.up_proj.weight, at + "up_proj", lora)
        return self._project(gated, mlp.down_proj.weight, at + "down_proj", lora)

    def _project(self, x: torch.Tensor, w: torch.Tensor, module: str, lora: _Lora) -> torch.Tensor:
        """x W^T through the engine's kernel, plus each row group's adapter of `module`, computed as
        SGLang's LoRA kernels do: (x A^T) through the kernel, then B, times alpha / r, added to the base
        output and rounded to the kernel's dtype (a bf16 kernel adds in bf16)."""
        y = self._linear(x, w)
        for adapter, rows in lora:
            pair = adapter.weights.get(module)
            if pair is None:
                continue
            xa = self._linear(x[rows], pair[0])
            y[rows] = self._round(y[rows] + self._linear(xa, pair[1]) * adapter.scaling)
        return y

    def _round(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.kernel.is_exact else t.to(_DTYPES[self.kernel.act_dtype]).float()

    def _sparse_moe(self, x: torch.Tensor, moe: _SparseMoe) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> (the experts' weighted sum [B, S, D], the chosen experts [B, S, top_k]), as
        transformers' Qwen3-MoE computes it: the router's logits through this engine's kernel, softmax
        in float32, the top_k experts (renormalised to sum 1 with norm_topk_prob), each token's output
        the routing-weighted sum of its experts' SwiGLU outputs."""
        s = self.shape
        probs = torch.softmax(self._linear(x, moe.gate.weight).float(), dim=-1)
        weights, chosen = torch.topk(probs, s.num_experts_per_tok, dim=-1)  # [B, S, k]
        if s.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat, out = x.reshape(-1, x.shape[-1]), torch.zeros(x.numel() // x.shape[-1], x.shape[-1])
        flat_chosen, flat_weights = (
            chosen.reshape(-1, s.num_experts_per_tok),
            weights.reshape(-1, s.num_experts_per_tok),
        )
        for e in torch.unique(flat_chosen).tolist():
            token, slot = torch.where(flat_chosen == e)
            expert = moe.experts[e]
            assert isinstance(expert, _MLP)  # nn.ModuleList yields nn.Module
            contribution = self._swiglu(flat[token], expert) * flat_weights[token, slot, None]
            out.index_add_(0, token, contribution)
        return out.reshape(x.shape), chosen

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, H, S, Dh], k/v [B, KVH, T, Dh] (grouped-query: each KV head serves H/KVH query heads)."""
        groups = self.shape.num_attention_heads // self.shape.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _cached_attention(
        self,
        q: torch.Tensor,  # [B, H, S, Dh]
        k: torch.Tensor,  # [B, KVH, S, Dh]
        v: torch.Tensor,
        cache: KVCache,
        layer_idx: int,
        rows: torch.Tensor,  # [B]
        start: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, S]
    ) -> torch.Tensor:
        seq = q.shape[2]
        kc, vc = cache.k[layer_idx], cache.v[layer_idx]  # [slots, KVH, T, Dh]
        # write the new keys/values into their slots at their positions (stored at the cache precision)
        b_idx = rows[:, None].expand(-1, seq)  # [B, S]
        kc[b_idx, :, positions] = cache.store(k).transpose(1, 2)  # index -> [B, S, KVH, Dh]
        vc[b_idx, :, positions] = cache.store(v).transpose(1, 2)
        t_len = int((start + seq).max())
        keys = kc[rows, :, :t_len]  # [B, KVH, T, Dh]
        values = vc[rows, :, :t_len]
        key_pos = torch.arange(t_len)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, S, T] causal within each row
        return self._attention(q, keys, values, mask[:, None])

    def new_cache(self, slots: int, capacity: int | None = None, kv_dtype: str = "auto") -> KVCache:
        """A slot cache for this model. `kv_dtype` "auto" is the model dtype, as SGLang resolves it
        (srt/mem_cache/kv_cache_dtype.py `configure_kv_cache_dtype`: "auto" -> model_dtype unless the
        checkpoint declares an FP8 KV cache, which rlfleet's views never do); the engine's model dtype is
        its kernel's activation dtype: bf16 for a bf16 kernel (what every sampler group runs), float32 for
        the exact kernel (tests that hold the engine to transformers)."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "auto":
            kv_dtype = "bf16" if self.kernel.act_dtype == "bfloat16" else "float32"
        return KVCache(self.shape, slots, capacity, kv_dtype)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Install HF-named weights (float32 copies); names and shapes must match exactly (a tied
        model takes `lm_head.weight` if given only when it equals the embedding)."""
        own = self.state_dict()
        if self.shape.tie_word_embeddings and "lm_head.weight" in weights:
            weights = dict(weights)
            head = weights.pop("lm_head.weight")
            embed = weights.get("model.embed_tokens.weight")
            if embed is not None and not torch.equal(head.float(), embed.float()):
                raise ValueError("tie_word_embeddings: lm_head.weight differs from model.embed_tokens.weight")
        extra = sorted(set(weights) - set(own))
        missing = sorted(set(own) - set(weights))
        if extra or missing:
            raise ValueError(f"weights do not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
        for name, t in weights.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != model {tuple(own[name].shape)}")
        with torch.no_grad():
            for name, t in weights.items():
                own[name].copy_(t.float())


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Which weights a quantized view / online quantization touches: the 2-D projections inside the
    decoder layers, each expert's included. Embeddings, norms, lm_head and a mixture of experts' router
    (`mlp.gate.weight`) stay in bf16, as in real FP8/NVFP4 checkpoints (SGLang and ModelOpt leave lm_head
    and the router unquantized)."""
    return tensor.dim() == 2 and name.startswith("model.layers.") and name.endswith("_proj.weight")


def precision_view(state_dict: dict[str, torch.Tensor], weight_format: str) -> dict[str, torch.Tensor]:
    """The float32 weights a sampler running `weight_format` really computes with.

    fp32: unchanged; bf16: every tensor rounded to bf16; fp8 | fp8_block | nvfp4 | mxfp4: projections
    round-tripped through the format (formats.fake_quantize), everything else bf16."""
    from rlfleet.numerics.formats import FORMATS, fake_quantize

    if weight_format not in FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {', '.join(FORMATS)}")
    out = {}
    for name, t in state_dict.items():
        t = t.detach().float()
        if weight_format == "fp32":
            out[name] = t.clone()
        elif weight_format != "bf16" and is_quantizable(name, t):
            out[name] = fake_quantize(t, weight_format)
        else:
            out[name] = t.to(torch.bfloat16).float()
    return out


def load_checkpoint(directory: str | Path) -> tuple[str, ModelShape, dict[str, torch.Tensor]]:
    """A Qwen3 checkpoint directory -> (view, shape, HF-named float32 weights). Either one of the weight
    channel's views (rlfleet/numerics/views.py: `rlfleet_view.json`, dequantized to what the view
    holds; view = its format) or a plain Hugging Face checkpoint (`*.safetensors`; view "fp32": the
    engine quantizes it online to its own format)."""
    from rlfleet.numerics.views import load_checkpoint_weights

    shape = ModelShape.from_checkpoint(directory)
    view, weights = load_checkpoint_weights(directory)
    if view is None:  # a plain HF checkpoint
        return "fp32", shape, {k: v.float() for k, v in weights.items()}
    return view, shape, weights
