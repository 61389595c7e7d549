"""The in-process fleet: sampler groups driven in this process without HTTP, and an in-memory version
sink, for the runs that need a whole fleet on 2 cores and no servers: the loop tests
(tests/trainer/test_trainer_loop.py, test_trainer_run_tracking.py) and the experiments' ablation and research
scripts (`rlfleet_experiments`, which import it from here).

`rlfleet run --local` never uses this: it starts the real reference sampler servers (`fleet.py`).
The ablation makes 80 runs of 120 steps (6 arms x 2 fleets x 5 seeds and the null-arm control) on
2 cores and uses this path for speed (docs/ablation.md). Each sampler IS the reference server's
engine (`rlfleet.sampler.reference_engine.ReferenceEngine`: the Qwen3 of rlfleet/numerics/engine_model.py held against transformers, its scheduler
steps, SGLang's torch sampling reference) driven in process by `run_batch`, with the product's one
format / KV table: the group's weights are the view the channel would publish for its weight format
(`rlfleet.numerics.views.view_weights`: the publisher's quantization, served as stored), its KV cache `ENGINE_KV[kvCacheDtype]` ("auto" is the model dtype,
bf16, as in SGLang), its kernel the GPU class's (bf16 activations, a split-K reduction order).
tests/local/test_local_emulated.py holds it to the reference server's logits for every
weight format and KV dtype.

Records are `SampledTurn`s exactly as the client builds them from SGLang: the engine's /generate answer
(`ReferenceEngine.response`) read by the client's parser (`parse_generate_response`): full-vocabulary
log q(y), the kept support with q renormalised inside it (support mode), or a top-K head of the
full-vocabulary q (head mode), the weight version per token, and (a Qwen3-MoE asked with
`SamplingConfig.routed_experts_top_k` > 0) the experts the group's engine routed every position to.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import torch

from rlfleet.numerics.engine_model import EngineModel, KernelConfig, ModelShape
from rlfleet.numerics.views import view_weights
from rlfleet.records import SUPPORT_MODE, SampledTurn
from rlfleet.sampler.protocol import SamplingConfig, parse_generate_response
from rlfleet.sampler.reference_engine import ENGINE_KV, EngineConfig, GenRequest, ReferenceEngine
from rlfleet.sampler.sampling import RowParams


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
        max_running_requests: int = 64,
    ) -> None:
        self.name = name
        self.weight_format = weight_format
        self.engine = ReferenceEngine(
            EngineConfig(
                model=model_config,
                weight_format=weight_format,
                kv_cache_dtype=ENGINE_KV[kv_cache_dtype],
                kernel=kernel or KernelConfig(act_dtype="bfloat16", split_k=2),
                max_running_requests=max_running_requests,
                served_model_name=name,
                seed=seed,
            ),
            weights=EngineModel(model_config).state_dict(),  # placeholders: it serves after `load_weights`
        )
        # one sampling stream for the group (seeded): the runs are reproducible batch by batch
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def load_weights(
        self, weights: dict[str, torch.Tensor], version: int, view: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Serve the view the channel publishes for this group's format, made from `weights`; `view`: that
        view already made (shared between groups, or the ablation's scaled one)."""
        if view is None:
            view = view_weights(weights, self.weight_format)
        self.engine.load_weights(view, self.weight_format, version)

    @torch.no_grad()
    def generate_batch(self, requests: list[Request], cfg: SamplingConfig) -> list[SampledTurn]:
        """All requests share `cfg`'s temperature, top_p, top_k, min_p, candidate_mode and head_size (each
        request has its own budget and stops), asked for as the client asks SGLang
        (`build_generate_request`) and read back by its parser; `cfg.routed_experts_top_k` > 0 (a
        Qwen3-MoE): each turn carries its routed experts, as SGLang returns them."""
        support = cfg.mode == SUPPORT_MODE
        vocab = self.engine.config.model.vocab_size
        reqs = [
            GenRequest(
                input_ids=list(r.input_ids),
                params=RowParams(cfg.temperature, cfg.top_p, cfg.wire_top_k(), cfg.min_p),
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=frozenset(r.stop_token_ids),
                return_logprob=True,
                return_mask=support,
                logprob_mode="support",
                top_logprobs_num=0 if support else min(cfg.head_size, vocab),
                generator=self.gen,
                return_routed_experts=cfg.routed_experts_top_k > 0,
            )
            for r in requests
        ]
        self.engine.run_batch(reqs)
        return [
            parse_generate_response(
                self.engine.response(req),
                req.input_ids,
                group=self.name,
                replica=f"{self.name}-0",
                vocab_size=vocab,
                untruncated=not cfg.truncates,
                routed_experts_top_k=cfg.routed_experts_top_k,
            )
            for req in reqs
        ]


class EmulatedFleet:
    """Async `generate(session, ids, params)` over in-process samplers: sessions stick to a group by
    the router's weighted rendezvous hash; concurrent requests of a group are batched."""

    def __init__(self, samplers: list[EmulatedSampler], shares: dict[str, float] | None = None) -> None:
        self.samplers = {s.name: s for s in samplers}
        self.shares = shares or {s.name: 1.0 for s in samplers}
        self._pending: dict[str, list[tuple[Request, SamplingConfig, asyncio.Future[SampledTurn]]]] = {
            s.name: [] for s in samplers
        }
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

    async def generate(self, session: str, input_ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        group = self.pick(session)
        fut: asyncio.Future[SampledTurn] = asyncio.get_running_loop().create_future()
        req = Request(list(input_ids), sampling.max_new_tokens, tuple(sampling.stop_token_ids))
        self._pending[group].append((req, sampling, fut))
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

    def _run(self, group: str, requests: list[Request], sampling: SamplingConfig) -> list[SampledTurn]:
        with self._lock:
            return self.samplers[group].generate_batch(requests, sampling)


class SnapshotSink:
    """A VersionSink (trainer/run.py) for the in-process fleet: published versions stay in memory, no
    channel."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def latest_version(self) -> int | None:
        return max(self.snapshots) if self.snapshots else None

    def publish(self, weights: dict[str, torch.Tensor], version: int, *, step: int) -> None:
        self.snapshots[version] = weights

    def fence(self) -> None:
        """No writer lease: the snapshots are this process's own."""
