"""TinyGPT: a small Llama-style causal transformer shared by the trainer's torch backend and the
reference sampler engine.

RMSNorm (pre-norm), rotary positions, SwiGLU MLP, untied lm_head, Hugging Face parameter names
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.input_layernorm.weight`,
`model.layers.{i}.post_attention_layernorm.weight`, `model.norm.weight`, `lm_head.weight`), so a
state dict can be saved as a safetensors checkpoint and quantized into views by name.

Two paths:
- `forward(input_ids [B, S]) -> logits float32 [B, S, V]`, causal, no cache (the trainer).
- `forward(input_ids [B, S], cache=KVCache, rows=LongTensor[B])`: appends S tokens to the given rows of
  a preallocated slot cache (rows may have different lengths: the sampler's batched decode) and
  returns logits for those S tokens.

The sampler-side knobs live on the module, not in the weights: `kernel` (activation/accumulation
dtype and split-K reduction order, so even bf16-vs-bf16 differs slightly, as real kernels do) and the
cache's `kv_dtype` (fp8_e4m3 round-trips K and V through E4M3 on write, like SGLang's fp8 KV cache with
scale 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlfleet.numerics.formats import fake_quantize_fp8_e4m3

KV_DTYPES = ("auto", "bf16", "fp8_e4m3")


@dataclass
class TinyGPTConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    max_seq_len: int = 256
    seed: int = 0
    d_ff: int | None = None  # SwiGLU hidden size; default 8/3 * d_model rounded up to a multiple of 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float | None = None  # projections' init std; None = 1/sqrt(fan_in) (layers then matter)
    # std of the initial logits (lm_head std = logit_std / sqrt(d_model)); > 1 makes the untrained model's
    # distributions peaked enough that top-k / top-p supports are small and interesting.
    logit_std: float = 2.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_head {self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dim must be even (rotary embeddings)")
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


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


class KVCache:
    """Preallocated slot cache: per layer K and V [slots, n_head, capacity, head_dim] (float32 storage;
    fp8_e4m3 values are rounded through E4M3 on write) and lengths [slots]."""

    def __init__(
        self, config: TinyGPTConfig, slots: int, capacity: int | None = None, kv_dtype: str = "auto"
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        self.capacity = capacity or config.max_seq_len
        self.kv_dtype = kv_dtype
        shape = (slots, config.n_head, self.capacity, config.head_dim)
        self.k = [torch.zeros(shape) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape) for _ in range(config.n_layer)]
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
    """cos, sin [B, 1, S, D] for positions [B, S] (computed once per forward, shared by the layers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [D/2]
    ang = positions.float()[..., None] * inv_freq  # [B, S, D/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None]  # [B, 1, S, D]
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention). x [B, H, S, D]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.k_proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.v_proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.d_model, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.d_model, eps=c.norm_eps)


class _Backbone(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)


class TinyGPT(nn.Module):
    def __init__(self, config: TinyGPTConfig, kernel: KernelConfig | None = None):
        super().__init__()
        self.config = config
        self.kernel = kernel or KernelConfig()
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters(config.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from `seed` (independent of the global RNG): embedding normal(0, 1),
        projections normal(0, init_std or 1/sqrt(fan_in)) with the residual outputs (o_proj, down_proj)
        scaled by 1/sqrt(2 n_layer), lm_head giving logits of std ~logit_std, norms at 1."""
        c = self.config
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
                continue
            std = c.init_std if c.init_std is not None else 1.0 / math.sqrt(p.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = std / math.sqrt(2 * c.n_layer)
            elif name == "lm_head.weight":
                std = c.logit_std / math.sqrt(c.d_model)
            elif name == "model.embed_tokens.weight":
                std = 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    # ------------------------------------------------------------------------------- kernels
    def _linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        w = layer.weight
        k = self.kernel
        if k.is_exact:
            return F.linear(x, w)
        dt = torch.bfloat16 if k.act_dtype == "bfloat16" else torch.float32
        xq, wq = x.to(dt), w.to(dt)
        if k.split_k == 1:
            # inputs rounded to dt, fp32 accumulation, output rounded to dt: what a bf16 GEMM does, and
            # ~10x faster on CPUs without native bf16 matmul than F.linear on bf16 tensors
            return F.linear(xq.float(), wq.float()).to(dt).float()
        chunks = torch.arange(x.shape[-1]).tensor_split(k.split_k)
        acc = None
        for idx in chunks:  # partial sums rounded to dt and added in order: a different reduction tree
            part = F.linear(xq[..., idx].float(), wq[:, idx].float()).to(dt)
            acc = part if acc is None else (acc + part)
        return acc.float()

    # ------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids LongTensor [B, S] -> logits float32 [B, S, V].

        With `cache`, the S new tokens of batch row b are appended to cache slot rows[b] (default
        rows = 0..B-1) after its cached tokens, attention covers that slot's cache, and the slot
        lengths advance by S."""
        c = self.config
        bsz, seq = input_ids.shape
        if cache is None:
            positions = torch.arange(seq).expand(bsz, seq)
            start = None
        else:
            rows = torch.arange(bsz) if rows is None else torch.as_tensor(rows, dtype=torch.long)
            start = cache.lengths[rows]  # [B]
            if int(start.max()) + seq > cache.capacity:
                raise ValueError(f"KV cache capacity {cache.capacity} exceeded")
            positions = start[:, None] + torch.arange(seq)  # [B, S]
        if int(positions.max()) >= c.max_seq_len:
            raise ValueError(f"sequence longer than max_seq_len {c.max_seq_len}")

        h = self.model.embed_tokens(input_ids).float()  # [B, S, D]
        cos, sin = _rope_tables(positions, c.head_dim, c.rope_theta)
        for li, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            att = layer.self_attn
            q = self._linear(x, att.q_proj).view(bsz, seq, c.n_head, c.head_dim).transpose(1, 2)  # [B,H,S,Dh]
            k = self._linear(x, att.k_proj).view(bsz, seq, c.n_head, c.head_dim).transpose(1, 2)
            v = self._linear(x, att.v_proj).view(bsz, seq, c.n_head, c.head_dim).transpose(1, 2)
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
            if cache is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = self._cached_attention(q, k, v, cache, li, rows, start, positions)
            o = o.transpose(1, 2).reshape(bsz, seq, c.d_model)
            h = h + self._linear(o, att.o_proj)
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            gated = F.silu(self._linear(x, mlp.gate_proj)) * self._linear(x, mlp.up_proj)
            h = h + self._linear(gated, mlp.down_proj)
        if cache is not None:
            cache.lengths[rows] += seq
        return self._linear(self.model.norm(h), self.lm_head).float()

    @staticmethod
    def _cached_attention(
        q: torch.Tensor,  # [B, H, S, Dh]
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        layer_idx: int,
        rows: torch.Tensor,  # [B]
        start: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B, S]
    ) -> torch.Tensor:
        seq = q.shape[2]
        kc, vc = cache.k[layer_idx], cache.v[layer_idx]  # [slots, H, T, Dh]
        # write the new keys/values into their slots at their positions (stored at the cache precision)
        b_idx = rows[:, None].expand(-1, seq)  # [B, S]
        kc[b_idx, :, positions] = cache.store(k).transpose(1, 2)  # index -> [B, S, H, Dh]
        vc[b_idx, :, positions] = cache.store(v).transpose(1, 2)
        t_len = int((start + seq).max())
        keys = kc[rows, :, :t_len]  # [B, H, T, Dh]
        values = vc[rows, :, :t_len]
        key_pos = torch.arange(t_len)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, S, T] causal within each row
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])

    def new_cache(self, slots: int, capacity: int | None = None, kv_dtype: str = "auto") -> KVCache:
        return KVCache(self.config, slots, capacity, kv_dtype)


def build_tinygpt(config: TinyGPTConfig, state_dict: dict[str, torch.Tensor] | None = None) -> TinyGPT:
    """A TinyGPT from a config, optionally loading an HF-named state dict (strict)."""
    model = TinyGPT(config)
    if state_dict is not None:
        model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return model


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Which weights a quantized view / online quantization touches: the 2-D projections inside the
    decoder layers. Embeddings, norms and lm_head stay in bf16, as in real FP8/NVFP4 checkpoints
    (SGLang and ModelOpt leave lm_head unquantized)."""
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


def config_from_state_dict(
    state_dict: dict[str, torch.Tensor], n_head: int, max_seq_len: int, seed: int = 0
) -> TinyGPTConfig:
    """Recover the shape part of a TinyGPTConfig from HF-named weights (n_head and max_seq_len are not
    visible in the shapes and must be given)."""
    try:
        vocab, d_model = state_dict["model.embed_tokens.weight"].shape
        n_layer = 1 + max(int(k.split(".")[2]) for k in state_dict if k.startswith("model.layers."))
        d_ff = state_dict["model.layers.0.mlp.gate_proj.weight"].shape[0]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not a TinyGPT state dict (missing {exc})") from None
    return TinyGPTConfig(
        vocab_size=int(vocab),
        n_layer=n_layer,
        n_head=n_head,
        d_model=int(d_model),
        max_seq_len=max_seq_len,
        seed=seed,
        d_ff=int(d_ff),
    )
