"""In-process emulated samplers (no HTTP) for the ablation and the loop's unit tests.

Local mode (`rlfleet run --local`) never uses this: it starts the real reference sampler servers.
The ablation runs 12 arms x tens of steps on 2 cores and uses this path for speed (documented in
docs/ablation.md). The emulation is the same as the reference server's: the reference engine's Qwen3
(rlfleet/numerics/engine_model.py, held against transformers) with the group's weight format applied by
`precision_view` (projections fake-quantised, the rest bf16), a bf16
kernel with a split-K reduction (so even a bf16 group differs from the fp32 trainer), the group's KV
cache dtype, and the sampler's implementation of SGLang's torch sampling reference
(`rlfleet.sampler.sampling.sample`: temperature, sorted top-k, top-p on the exclusive cumulative sum).

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

from rlfleet.numerics.engine_model import EngineModel, KernelConfig, ModelShape, precision_view
from rlfleet.records import HEAD_MODE, SUPPORT_MODE, SampledTurn
from rlfleet.sampler.sampling import RowParams, sample

# RLJob weightFormat -> the fake-quantisation format of the emulation (fp8 views are block-128).
VIEW_FORMATS = {"bf16": "bf16", "fp8": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}
# SGLang --kv-cache-dtype -> the engine's cache emulation (formats it cannot emulate round like fp8).
KV_EMULATION = {"auto": "bf16", "bf16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e4m3",
                "mxfp8": "fp8_e4m3", "nvfp4": "fp8_e4m3"}


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
        model_config: ModelShape,
        seed: int = 0,
        kernel: KernelConfig | None = None,
    ) -> None:
        self.name = name
        self.weight_format = weight_format
        self.kv_dtype = KV_EMULATION.get(kv_cache_dtype, "bf16")
        self.model = EngineModel(model_config, kernel or KernelConfig(act_dtype="bfloat16", split_k=2)).eval()
        self.version = 0
        self.gen = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict[str, torch.Tensor], version: int, view: dict[str, torch.Tensor] | None = None) -> None:
        """`view`: the already fake-quantised weights of this group's format (shared between groups)."""
        self.model.load_weights(view if view is not None else precision_view(weights, VIEW_FORMATS[self.weight_format]))
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
        logits = torch.empty(n, self.model.shape.vocab_size)
        by_len: dict[int, list[int]] = {}
        for b, r in enumerate(requests):  # ragged prompts: one batched prefill per prompt length
            by_len.setdefault(len(r.input_ids), []).append(b)
        for rows in by_len.values():
            ids = torch.tensor([requests[b].input_ids for b in rows])
            logits[rows] = self.model(ids, cache, rows=torch.tensor(rows))[:, -1]
        outs: list[dict[str, list]] = [{"ids": [], "lq": [], "lqs": [], "sid": [], "slq": []} for _ in range(n)]
        finish = ["length"] * n
        active = list(range(n))
        row = RowParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0)
        while active:
            res = sample(logits, [row] * len(active), [self.gen] * len(active))
            k = min(head, logits.shape[1])
            heads = res.top_logprobs([k] * len(active)) if mode == HEAD_MODE else None
            still = []
            for j, b in enumerate(active):
                o = outs[b]
                tok = int(res.token_ids[j])
                o["ids"].append(tok)
                o["lq"].append(res.token_logprob(j))
                if heads is not None:
                    o["sid"].append([h[1] for h in heads[j]])
                    o["slq"].append([h[0] for h in heads[j]])
                    o["lqs"].append(float("nan"))
                else:
                    ids, lps = res.mask(j)
                    o["sid"].append(ids)
                    o["slq"].append(lps)
                    o["lqs"].append(float(res.selected_logprobs[j]))
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
