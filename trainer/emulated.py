"""In-process emulated samplers (no HTTP) for the ablation and the loop's unit tests.

Local mode (`rlfleet run --local`) never uses this: it starts the real reference sampler servers.
The ablation runs 12 arms x tens of steps on 2 cores and uses this path for speed (documented in
docs/ablation.md). The emulation is the same as the reference server's: TinyGPT with the group's
weight format applied by `rlfleet.numerics.formats.fake_quantize` to every linear projection, a bf16
kernel with a split-K reduction (so even a bf16 group differs from the fp32 trainer), the group's KV
cache dtype, and SGLang's torch sampling reference: temperature, sorted top-k, top-p on the
exclusive cumulative sum (the token crossing top_p is kept).

Records are `SampledTurn`s exactly as the client builds them from SGLang: full-vocabulary log q(y)
before truncation, the kept support with q renormalised inside it (support mode), or a top-K head of
the full-vocabulary q (head mode, for full-vocabulary score centering), the weight version per token.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfleet.numerics.formats import fake_quantize
from rlfleet.numerics.tinygpt import KernelConfig, TinyGPT, TinyGPTConfig
from rlfleet.records import HEAD_MODE, SUPPORT_MODE, SampledTurn

# RLJob weightFormat -> the fake-quantisation format of the emulation (fp8 views are block-128).
VIEW_FORMATS = {"bf16": "bf16", "fp8": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}
# SGLang --kv-cache-dtype -> the TinyGPT cache emulation (formats it cannot emulate round like fp8).
KV_EMULATION = {"auto": "bf16", "bf16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e4m3",
                "mxfp8": "fp8_e4m3", "nvfp4": "fp8_e4m3"}


def quantized_weights(weights: dict[str, torch.Tensor], weight_format: str) -> dict[str, torch.Tensor]:
    """The weights a group of this format really computes with: projections in the format, the rest
    (embeddings, norms, lm_head) rounded to bf16 as served checkpoints keep them."""
    fmt = VIEW_FORMATS[weight_format]
    out = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight") and w.dim() == 2:
            out[name] = fake_quantize(w.float(), fmt)
        else:
            out[name] = w.float().to(torch.bfloat16).float()
    return out


def sglang_sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's torch sampling reference on logits [B, V].

    Returns y [B], log q(y) full-vocab [B], sorted ids [B, V], log q full sorted [B, V], kept [B, V]
    (bool, a prefix of the sorted order: top-k then top-p with the exclusive cumsum)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    probs_sort, idx = probs.sort(dim=-1, descending=True)
    cums = probs_sort.cumsum(dim=-1)
    ranks = torch.arange(probs.shape[-1])[None, :]
    kept = torch.ones_like(probs_sort, dtype=torch.bool)
    if top_k > 0:
        kept &= ranks < top_k
    kept &= (cums - probs_sort) <= top_p
    kept[:, 0] = True
    weights = torch.where(kept, probs_sort, 0.0)
    choice = torch.multinomial(weights, 1, generator=gen)[:, 0]  # position in the sorted order
    y = idx.gather(1, choice[:, None])[:, 0]
    return y, logp.gather(1, y[:, None])[:, 0], idx, logp.gather(1, idx), kept


@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()


class EmulatedSampler:
    """One sampler group's engine, in process. `generate_batch` is synchronous and batched."""

    def __init__(
        self,
        name: str,
        weight_format: str,
        kv_cache_dtype: str,
        model_config: TinyGPTConfig,
        seed: int = 0,
        kernel: KernelConfig | None = None,
    ) -> None:
        self.name = name
        self.weight_format = weight_format
        self.kv_dtype = KV_EMULATION.get(kv_cache_dtype, "bf16")
        self.model = TinyGPT(model_config, kernel or KernelConfig(act_dtype="bfloat16", split_k=2)).eval()
        self.version = 0
        self.gen = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(quantized_weights(weights, self.weight_format), strict=True)
        self.version = int(version)

    @torch.no_grad()
    def generate_batch(self, requests: list[Request], sampling: dict[str, Any]) -> list[SampledTurn]:
        """All requests share `sampling` (temperature, top_p, top_k, candidate_mode, head_size)."""
        temperature = float(sampling.get("temperature", 1.0))
        top_k = int(sampling.get("top_k", -1))
        top_p = float(sampling.get("top_p", 1.0))
        mode = sampling.get("candidate_mode", SUPPORT_MODE)
        head = int(sampling.get("head_size", 128))
        n = len(requests)
        cap = max(len(r.input_ids) + r.max_new_tokens for r in requests)
        cache = self.model.new_cache(n, capacity=cap, kv_dtype=self.kv_dtype)
        last = []
        for b, r in enumerate(requests):  # ragged prompts: prefill row by row
            logits = self.model(torch.tensor([r.input_ids]), cache, rows=torch.tensor([b]))
            last.append(logits[0, -1])
        logits = torch.stack(last)  # [B, V]
        outs: list[dict[str, list]] = [{"ids": [], "lq": [], "lqs": [], "sid": [], "slq": []} for _ in range(n)]
        finish = ["length"] * n
        active = list(range(n))
        while active:
            y, lq, idx, lq_sorted, kept = sglang_sample(logits, temperature, top_k, top_p, self.gen)
            still = []
            for j, b in enumerate(active):
                o = outs[b]
                tok = int(y[j])
                o["ids"].append(tok)
                o["lq"].append(float(lq[j]))
                if mode == HEAD_MODE:
                    k = min(head, idx.shape[1])
                    o["sid"].append(idx[j, :k].tolist())
                    o["slq"].append(lq_sorted[j, :k].tolist())
                    o["lqs"].append(float("nan"))
                else:
                    m = int(kept[j].sum())
                    ls = lq_sorted[j, :m]
                    ls = ls - torch.logsumexp(ls, 0)
                    ids = idx[j, :m].tolist()
                    o["sid"].append(ids)
                    o["slq"].append(ls.tolist())
                    o["lqs"].append(float(ls[ids.index(tok)]))
                r = requests[b]
                if tok in r.stop_token_ids:
                    finish[b] = "stop"
                elif len(o["ids"]) < r.max_new_tokens:
                    still.append((j, b))
            if not still:
                break
            rows = torch.tensor([b for _, b in still])
            nxt = torch.tensor([[outs[b]["ids"][-1]] for _, b in still])
            logits = self.model(nxt, cache, rows=rows)[:, -1]
            active = [b for _, b in still]
        turns = []
        for b, r in enumerate(requests):
            o = outs[b]
            counts = [len(s) for s in o["sid"]]
            offsets = np.zeros(len(counts) + 1, dtype=np.int32)
            np.cumsum(counts, out=offsets[1:])
            turns.append(
                SampledTurn(
                    prompt_ids=np.asarray(r.input_ids, dtype=np.int32),
                    output_ids=np.asarray(o["ids"], dtype=np.int32),
                    logprobs=np.asarray(o["lq"], dtype=np.float32),
                    sampled_logprobs=np.asarray(o["lqs"], dtype=np.float32),
                    support_offsets=offsets,
                    support_ids=np.asarray([i for s in o["sid"] for i in s], dtype=np.int32),
                    support_logprobs=np.asarray([v for s in o["slq"] for v in s], dtype=np.float32),
                    weight_versions=np.full(len(o["ids"]), self.version, dtype=np.int64),
                    candidate_mode=mode,
                    finish_reason=finish[b],
                    group=self.name,
                    replica=f"{self.name}-0",
                )
            )
        return turns


class EmulatedFleet:
    """Async `generate(session, ids, params)` over in-process samplers: sessions stick to a group by
    the router's weighted rendezvous hash; concurrent requests of a group are batched."""

    def __init__(self, samplers: list[EmulatedSampler], shares: dict[str, float] | None = None) -> None:
        self.samplers = {s.name: s for s in samplers}
        self.shares = shares or {s.name: 1.0 for s in samplers}
        self._pending: dict[str, list[tuple[Request, dict, asyncio.Future]]] = {s.name: [] for s in samplers}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock = threading.Lock()  # weights swap (trainer thread) vs generation (rollout thread)

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            for s in self.samplers.values():
                s.load_weights(weights, version)

    def pick(self, session: str) -> str:
        from rlfleet.router.hashing import pick

        live = {g: w for g, w in self.shares.items() if w > 0}
        return pick(session, live) or next(iter(self.samplers))

    async def generate(self, session: str, input_ids: list[int], params: dict[str, Any]) -> SampledTurn:
        group = self.pick(session)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        req = Request(list(input_ids), int(params["max_new_tokens"]), tuple(params.get("stop_token_ids", ())))
        self._pending[group].append((req, params, fut))
        lock = self._locks.setdefault(group, asyncio.Lock())
        async with lock:
            batch = self._pending[group]
            if batch:
                self._pending[group] = []
                try:
                    turns = await asyncio.to_thread(self._run, group, [r for r, _, _ in batch], batch[0][1])
                    for (_, _, f), t in zip(batch, turns, strict=True):
                        f.set_result(t)
                except Exception as exc:
                    for _, _, f in batch:
                        f.set_exception(exc)
        return await fut

    def _run(self, group: str, requests: list[Request], params: dict[str, Any]) -> list[SampledTurn]:
        with self._lock:
            return self.samplers[group].generate_batch(requests, params)
