"""`rlfleet run RLJOB.yaml --local`: the same RLJob manifest as on a cluster, on this machine.

What starts (all on 127.0.0.1, free ports chosen by the OS):
- a weight channel on a local directory (`<out>/channel`, the filesystem store),
- ONE fleet-host subprocess (rlfleet/local/fleet.py) with a real reference sampler server per sampler group
  (the group's weight format, KV-cache dtype and a per-GPU-class kernel, emulated on CPU), the router
  in front of them, and a weight-sync loop per group, closed with a random key per run that only their
  environment holds (docs/local.md, "The engine API"),
- the trainer in this process: a tiny Qwen3 checkpoint built from the manifest's `local.model`
  (rlfleet/tiny_qwen3.py: transformers' `Qwen3ForCausalLM` saved with `save_pretrained`, a tokenizer built
  with `tokenizers`; cached under `<out>/models`) trained by the same transformers backend a cluster's
  `trainer.backend: torch` runs, the corrected objective of
  `correction.mode`, the async rollout driver talking to the router, the collapse detector, wired by
  the one training composition root (trainer/run.py `run_training`, as on a cluster): version 0 of
  every view is in the channel before the fleet starts and before step 1.
The manifest's `local` block sizes the run (steps, prompts per step, samples per prompt, tokens per
turn, the tiny model); everything else (groups, correction, sampling, staleness, safety) applies as
written. Ctrl-C stops at the next step boundary (a second Ctrl-C stops at once); the run checkpoints
every step, so `--resume` continues it. A report (metrics JSON/CSV + plots) lands in `<out>/report`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.api.common import ENGINE_API_KEY_ENV
from rlfleet.catalog import Catalog, get_catalog
from rlfleet.fleet import REFERENCE_WEIGHT_FORMAT, FleetEconomics, MeasuredGroup, measured_economics
from rlfleet.local import rundir
from rlfleet.trainer.config import RunConfig, build_environment, resolve_run

if TYPE_CHECKING:
    from rlfleet.trainer.collapse import Decision
    from rlfleet.trainer.envs.environments import Environment
    from rlfleet.trainer.envs.prompts import PromptSource
    from rlfleet.trainer.rollout.driver import PromptGroup, RolloutDriver
    from rlfleet.trainer.run import BaseModel

FLEET_LOG = "fleet.log"
RUN_JSON = "run.json"
# per-episode task figures of the run summary: (metric, label); trainer/metrics.py rollout_metrics
TASK_FIGURES = (
    ("success_rate", "task success"),
    ("format_error_rate", "episodes with a malformed turn"),
    ("test_infra_touched_rate", "graded patches touching test files"),
)  # SWE: a reward-hacking precursor
# summary key prefix -> the per-step metric averaged over the first and last window (`<prefix>_first`, `_last`)
SUMMARY_METRICS = {"reward": "reward_mean", "entropy": "entropy", **{key: key for key, _ in TASK_FIGURES},
                   "cost_per_1m_usable_tokens": "cost_per_1m_usable_tokens",
                   "estimated_saving": "estimated_saving"}  # fmt: skip


EXIT_FLEET_DIED = (
    8  # the fleet host died during the run (docs/local.md, "Exit codes"; the others: trainer/failures.py)
)
FLEET_LOG_TAIL = 12  # lines of fleet.log quoted when the fleet host dies


class LocalRunError(RuntimeError):
    """A clear problem with the run, printed without a stack trace: one line, exit `code` (2: the run
    cannot start as given; a runtime failure's own code, trainer/failures.py; EXIT_FLEET_DIED)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------ display
class Progress:
    """Live progress with rich: step, reward, and a per-group table (tok/s, share, version lag, KL, OOR).
    Plain one-line-per-step output when stdout is not a terminal (tests, CI, logs)."""

    def __init__(self, rc: RunConfig, live: bool) -> None:
        self.rc = rc
        self.t0 = time.monotonic()
        self.last_t = self.t0
        self.live = None
        if live:
            from rich.console import Console
            from rich.live import Live

            console = Console()
            if console.is_terminal:
                self.live = Live(self._render(None, []), console=console, refresh_per_second=4)
                self.live.start()

    def _render(self, m: dict[str, float] | None, alerts: list[str]) -> Any:
        from rich.console import Group, RenderableType
        from rich.table import Table
        from rich.text import Text

        rc = self.rc
        if m is None:
            return Text(
                f"{rc.job_name}: starting {len(rc.groups)} sampler groups, router and weight channel ..."
            )
        head = Text(
            f"{rc.job_name}  step {int(m['step'])}/{rc.steps}  reward {m.get('reward_mean', 0):.3f}  "
            f"KL {m.get('kl_k3', 0):.4f}  OOR {m.get('oor_fraction', 0):.3%}  entropy {m.get('entropy', 0):.3f}  "
            f"grad {m.get('grad_norm', 0):.3g}  staleness {m.get('staleness_mean', 0):.2f}  "
            f"elapsed {time.monotonic() - self.t0:.0f}s"
        )
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("group", no_wrap=True, min_width=max(len(g.name) for g in rc.groups))
        for col in ("fmt", "KV", "tok/s", "share", "ver", "lag", "KL", "OOR", "usable", "$/1M", "reward"):
            table.add_column(col, justify="left" if col in ("fmt", "KV") else "right", no_wrap=True)
        for g in rc.groups:
            p = f"group/{g.name}/"
            n = m.get(p + "num_tokens", 0.0)
            version = m.get(p + "version_max")
            table.add_row(
                g.name,
                g.weight_format,
                g.kv_cache_dtype,
                f"{m.get(p + 'tokens_per_second', 0):.0f}",
                f"{m.get(p + 'token_share', 0):.0%}",
                "-" if version is None else f"{version:.0f}",
                "-"
                if version is None
                else f"{m.get('weight_version', m['step']) - 1 - version:.0f}",  # version != step after a fallback
                f"{m.get(p + 'kl_k3', 0):.4f}" if n else "-",
                f"{m.get(p + 'oor_fraction', 0):.2%}" if n else "-",
                f"{m[p + 'usable_fraction']:.0%}" if p + "usable_fraction" in m else "-",
                _dollars(m.get(p + "cost_per_1m_usable_tokens")),
                f"{m.get(p + 'reward_mean', 0):.2f}" if p + "reward_mean" in m else "-",
            )
        parts: list[RenderableType] = [head, table, Text(cost_line(self.rc, m))]
        if alerts:
            parts.append(Text("collapse detector: " + "; ".join(alerts), style="bold red"))
        return Group(*parts)

    def update(self, m: dict[str, float], alerts: list[str]) -> None:
        if self.live is not None:
            self.live.update(self._render(m, alerts))
        else:
            print(
                f"step {int(m['step'])}/{self.rc.steps} reward={m.get('reward_mean', 0):.3f} kl={m.get('kl_k3', 0):.4f} "
                f"oor={m.get('oor_fraction', 0):.4f} entropy={m.get('entropy', 0):.3f} grad_norm={m.get('grad_norm', 0):.3g} "
                f"staleness={m.get('staleness_mean', 0):.2f}"
                + (
                    ""
                    if (cost := m.get("cost_per_1m_usable_tokens")) is None
                    else f" usd_per_1m_usable={cost:.4g}"
                )
                + (f" ALERT {'; '.join(alerts)}" if alerts else ""),
                flush=True,
            )

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def _dollars(value: float | None) -> str:
    return "-" if value is None else f"${value:.3g}"


def cost_line(rc: RunConfig, m: dict[str, float]) -> str:
    """The step's fleet cost per usable token at the CPU's speed and the fleet's estimated saving at GPU
    speed, one line (the live table's foot)."""
    return (
        f"fleet {_dollars(m.get('cost_per_hour'))}/h, {_dollars(m.get('cost_per_1m_usable_tokens'))} per 1M usable tokens "
        f"at CPU speed; {rc.reference_accelerator} {REFERENCE_WEIGHT_FORMAT}"
        + (" (estimated from catalog throughput ratios)" if m.get("reference_estimated") else "")
        + f" {_dollars(m.get('reference_cost_per_1m_usable_tokens'))}"
        + estimated_saving_text(rc, m.get("estimated_saving"))
    )


def estimated_saving_text(rc: RunConfig, saving: float | None) -> str:
    """ "; estimated saving S against <reference> bf16 (catalog throughput ratios)", or "" without one."""
    if saving is None:
        return ""
    return f"; estimated saving {saving:.1%} against {rc.reference_accelerator} {REFERENCE_WEIGHT_FORMAT} (catalog throughput ratios)"


def step_economics(rc: RunConfig, m: dict[str, float]) -> dict[str, float]:
    """The step's cost figures (rlfleet/fleet.py `measured_economics`) as metrics: per group
    `group/<g>/cost_per_hour`, `group/<g>/usable_fraction`, `group/<g>/cost_per_1m_usable_tokens`; for the
    fleet `cost_per_hour`, `usable_fraction`, `cost_per_1m_usable_tokens`,
    `reference_cost_per_1m_usable_tokens` (`router.reference.accelerator`, default the trainer's class,
    at bf16, from the run's bf16 groups of that class, else estimated from the other groups by the catalog's
    throughput ratios: then `reference_estimated` is 1). From the step's
    tokens/s, out-of-range share and trained fraction per group in `m` and the catalog's prices, one replica per group
    (`tensorParallel` GPUs) as local mode runs them: the mix and the precisions priced at the CPU's
    speed, not a cluster's (no saving is derived from them: CPU speeds are not the classes' speeds).
    And `estimated_saving`: the same economics with each group's and the reference's tokens/s the
    catalog's relative decode throughput of their class and format (`fleet_at_catalog_speed`), the
    usable shares as measured. Unknown figures are left out."""
    catalog = get_catalog()
    groups = []
    for g in rc.groups:
        cls = catalog.get(g.accelerator)
        p = f"group/{g.name}/"
        groups.append(
            MeasuredGroup(
                g.name,
                g.accelerator,
                g.weight_format,
                g.tensor_parallel or cls.default_tensor_parallel,
                cls.cost_per_gpu_hour,
                m.get(p + "tokens_per_second"),
                m.get(p + "oor_fraction"),
                m.get(p + "trained_fraction"),
            )
        )
    e = measured_economics(
        groups,
        rc.reference_accelerator,
        catalog.get(rc.reference_accelerator).cost_per_gpu_hour,
        catalog=catalog,
    )
    figures: dict[str, float | None] = {
        "cost_per_hour": e.cost_per_hour,
        "usable_fraction": e.usable_fraction,
        "cost_per_1m_usable_tokens": e.cost_per_1m_usable_tokens,
        "reference_cost_per_1m_usable_tokens": e.reference_cost_per_1m_usable_tokens,
        "reference_estimated": None if e.reference_basis is None else float(e.reference_basis == "estimated"),
        "estimated_saving": fleet_at_catalog_speed(groups, rc.reference_accelerator, catalog).saving,
    }
    for name, ge in e.groups.items():
        figures[f"group/{name}/cost_per_hour"] = ge.cost_per_hour
        figures[f"group/{name}/usable_fraction"] = (
            ge.usable_fraction if ge.tokens_per_second is not None else None
        )
        figures[f"group/{name}/cost_per_1m_usable_tokens"] = ge.cost_per_1m_usable_tokens
    return {k: v for k, v in figures.items() if v is not None}


def fleet_at_catalog_speed(
    groups: list[MeasuredGroup], reference_accelerator: str, catalog: Catalog
) -> FleetEconomics:
    """The fleet's economics at the speeds of its GPU classes: each group making the catalog's relative
    decode throughput of its class and format per GPU (H100 bf16 = 1), the reference its class's at
    bf16, at the catalog's prices, with the usable shares measured (a group without a reading this step
    counts as all usable). The unit of throughput cancels in the saving, which is the figure to read (its
    cost per token is in relative units). No saving when a group's class or the reference has no ratio
    (the `cpu` class)."""
    ratios = [catalog.decode_throughput(g.accelerator, g.weight_format) for g in groups]
    reference = catalog.decode_throughput(reference_accelerator, REFERENCE_WEIGHT_FORMAT)
    at_speed = [
        replace(g, tokens_per_second=None if r is None else r * g.gpus)
        for g, r in zip(groups, ratios, strict=True)
    ]
    if reference is None or any(r is None for r in ratios):
        at_speed = []  # an estimate without one of the groups would price a smaller fleet
    return measured_economics(
        at_speed,
        reference_accelerator,
        catalog.get(reference_accelerator).cost_per_gpu_hour,
        reference_tokens_per_gpu_second=reference,
        catalog=catalog,
    )


def group_rollout_extras(groups: list[PromptGroup], dt: float) -> dict[str, float]:
    """Per-group tokens/s and newest weight version seen in this step's rollouts (for the live table)."""
    tokens: dict[str, int] = {}
    newest: dict[str, int] = {}
    for g in groups:
        for r in g.rollouts:
            for t in r.turns:
                tokens[t.group] = tokens.get(t.group, 0) + t.num_tokens
                if t.num_tokens:
                    newest[t.group] = max(newest.get(t.group, -1), int(max(t.weight_versions)))
    out = {}
    for name, n in tokens.items():
        out[f"group/{name}/tokens_per_second"] = n / dt if dt > 0 else 0.0
    for name, v in newest.items():
        out[f"group/{name}/version_max"] = float(v)
    return out


# ------------------------------------------------------------------------------------------ the run
class FleetProcess:
    """The fleet-host subprocess (servers + router + syncers). Started and stopped by its pid only; while
    it runs, `watch` polls it, so that its death ends the run in seconds (issue 32 item 7)."""

    def __init__(self, spec_path: Path, log_path: Path, admin_token: str, api_key: str | None = None) -> None:
        # secrets by environment only: never on the command line (any user's `ps` shows it), in fleet.json
        # or in a log; the host's /proc/PID/environ is readable by this user (and root) alone
        env = {**os.environ, "RLFLEET_ROUTER_ADMIN_TOKEN": admin_token, "PYTHONUNBUFFERED": "1"}
        if api_key is not None:
            env[ENGINE_API_KEY_ENV] = api_key
        self.log = open(log_path, "ab")
        # cwd = the run directory: `python -m` puts cwd on sys.path, and the repo root must never be
        # there (its operator/ folder would shadow the standard library).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.local.fleet", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=spec_path.parent,
            env=env,
            start_new_session=True,  # our Ctrl-C goes to the trainer, which stops the fleet in order
        )
        self.log_path = log_path
        self._stopping = threading.Event()  # set by stop(): the exit that follows is ours, not a death

    def watch(self, on_death: Callable[[], None], interval: float = 0.5) -> None:
        """Call `on_death()` once if the host exits before `stop()` (a thread polling its pid)."""

        def poll() -> None:
            while not self._stopping.wait(interval):
                if self.proc.poll() is not None:
                    if not self._stopping.is_set():
                        on_death()
                    return

        threading.Thread(target=poll, name="fleet-watch", daemon=True).start()

    def died(self) -> str | None:
        """How the host ended when it ended by itself ("killed by SIGKILL", "exited with code 1"); None
        while it runs or after `stop()`."""
        code = self.proc.poll()
        if code is None or self._stopping.is_set():
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def death_message(self, how: str, when: str, resume_hint: str) -> str:
        """The run's last word when the host died: what and how, the tail of its log, the resume command."""
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-FLEET_LOG_TAIL:]
        except OSError as exc:
            tail = [f"(unreadable: {exc.strerror})"]
        lines = [
            f"the fleet host (pid {self.proc.pid}: the sampler servers, the router and the weight sync) "
            f"{how} {when}. The end of its log {self.log_path}:",
            *(f"    {line}" for line in tail),
        ]
        lines.append(
            f"resume with: {resume_hint}" if resume_hint else "resume: run the same command with --resume"
        )
        return "\n".join(lines)

    def wait_ready(self, timeout: float = 180.0, resume_hint: str = "") -> dict[str, Any]:
        box: dict[str, Any] = {}

        def read() -> None:
            line = self.proc.stdout.readline() if self.proc.stdout else b""
            box["line"] = line

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line", b"")
        if not line:
            if not t.is_alive():  # its stdout closed: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
            how = self.died()
            self.stop()
            if how is not None:
                raise LocalRunError(self.death_message(how, "while it started", resume_hint), EXIT_FLEET_DIED)
            raise LocalRunError(f"the sampler fleet did not start in {timeout:.0f}s (see {self.log_path})")
        return json.loads(line)

    def stop(self, timeout: float = 15.0) -> None:
        self._stopping.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.log.close()


class FleetRollouts:
    """The run's rollout side: the fleet host, started when the trainer's version `start_step` is in the
    channel (run_training calls `make_driver`), watched while it runs, and the driver in front of its
    router. Its death sets `stop`: the loop ends at once, and the run ends with `stop()`'s message."""

    def __init__(
        self,
        out: Path,
        rc: RunConfig,
        base: BaseModel,
        env: Environment,
        prompts: PromptSource,
        stop: threading.Event,
        resume_hint: str,
        start_step: int,
    ) -> None:
        self.out, self.rc, self.base, self.env, self.prompts = out, rc, base, env, prompts
        self.stop_event, self.resume_hint, self.start_step = stop, resume_hint, start_step
        self.admin_token = secrets.token_hex(16)
        # the run's engine key (docs/local.md, "The engine API"): the fleet host's engines, sync loops and
        # router use it; the driver presents it to the router
        self.api_key = secrets.token_urlsafe(32)
        self.fleet: FleetProcess | None = None
        self.router = ""
        self.driver: RolloutDriver | None = None

    def make_driver(self, position: int) -> RolloutDriver:
        import asyncio

        from rlfleet.local.fleet import RunningFleet, wait_until_serving
        from rlfleet.sampler.client import SamplerClient
        from rlfleet.trainer.rollout.driver import RolloutDriver
        from rlfleet.trainer.run import rollout_sampling

        fleet = self.fleet = FleetProcess(
            self.out / "fleet.json", self.out / FLEET_LOG, self.admin_token, self.api_key
        )
        fleet.watch(self.stop_event.set)  # its death stops the loop at once; `stop()` then says so
        urls = fleet.wait_ready(resume_hint=self.resume_hint)
        self.router = urls["router"]
        serving = RunningFleet(router_url=self.router, servers=urls["servers"], api_key=self.api_key)
        asyncio.run(
            wait_until_serving(
                serving,
                self.start_step,
                alive=lambda: fleet.proc.poll() is None,
                adapters=self.rc.lora is not None,
            )
        )
        how = fleet.died()
        if how is not None:
            raise LocalRunError(
                fleet.death_message(how, "while it started", self.resume_hint), EXIT_FLEET_DIED
            )
        rc, base = self.rc, self.base
        self.driver = RolloutDriver(
            SamplerClient(
                self.router, vocab_size=base.vocab_size, api_key=self.api_key, adapters=rc.lora is not None
            ),
            self.env,
            self.prompts,
            samples_per_prompt=rc.samples_per_prompt,
            max_seq_len=base.max_seq_len,
            sampling=rollout_sampling(rc, base),
            start_position=position,
            max_ahead_prompts=2 * rc.prompts_per_step,
        )
        return self.driver

    def quarantine(self, groups: list[str]) -> None:
        """The collapse detector's decision, through the router's admin API."""
        import httpx

        for group in groups:
            httpx.put(
                f"{self.router}/admin/groups/{group}",
                json={"quarantined": True},
                headers={"Authorization": f"Bearer {self.admin_token}"},
                timeout=5,
            )

    def failure(self, exc: Exception) -> Exception:
        """`run_failure` with what the rollout side knows (the router, the driver's outage)."""
        detail = self.driver.outage_note() if self.driver is not None else ""
        return run_failure(exc, self.out, self.resume_hint, router=self.router, detail=detail)

    def stop(self) -> str | None:
        """Stop the fleet host; how it ended when it had died by itself ("killed by SIGKILL"), else None."""
        if self.fleet is None:
            return None
        how = self.fleet.died()  # before stop(): the exit stop() causes is not a death
        self.fleet.stop()
        return how


def summary_window(steps: int) -> int:
    """Steps in the summary's first and last windows: a third of the run, 1 to 3 steps."""
    return max(1, min(3, steps // 3))


def window_mean(history: list[dict[str, float]], key: str, k: int, end: str) -> float | None:
    """Mean of `key` over the first (`end` "first") or last k steps of `history` that have it; None: none has."""
    values = [h[key] for h in history if key in h]
    part = values[:k] if end == "first" else values[-k:]
    return sum(part) / len(part) if part else None


def run_failure(exc: Exception, out: Path, resume_hint: str, router: str = "", detail: str = "") -> Exception:
    """A runtime failure of trainer/failures.py as a LocalRunError (one line, its exit code); any other
    error as it is (a bug: its traceback)."""
    from rlfleet.trainer.failures import FailureContext, describe_failure

    described = describe_failure(
        exc,
        FailureContext(
            store=str(out / "channel"),
            checkpoints=str(out / "checkpoints"),
            router=router or "of the fleet host",
            rollout_logs=str(out / FLEET_LOG),
            own_store="its own --out directory",
            continue_with=f"resume with: {resume_hint}"
            if resume_hint
            else "run the same command with --resume",
            detail=detail,
        ),
    )
    if described is None:
        return exc
    code, line = described
    return LocalRunError(line, code)


def prepare_out(out: Path, rc: RunConfig, *, resume: bool, force: bool) -> dict[str, Any] | None:
    """Check and prepare the run directory, its lock held; returns the checkpoint state to resume from
    (None: a fresh run). A fresh run never silently replaces a run's checkpoints (--force does) nor
    removes anything but rlfleet's own files; a resume needs a checkpoint, and a target beyond its step."""
    from rlfleet.trainer.publish import checkpoint as ckpt

    ckpt_dir = out / "checkpoints"
    if resume:
        try:
            state = ckpt.load_latest(ckpt_dir) if ckpt_dir.is_dir() else None
        except ckpt.CheckpointError as exc:
            raise run_failure(exc, out, resume_hint="") from None
        if state is None:
            raise LocalRunError(f"nothing to resume in {out} (no checkpoint); run without --resume to start")
        step = int(state["step"])
        if step >= rc.steps:
            where = (
                f"is complete (step {step} of {rc.steps})"
                if step == rc.steps
                else f"is at step {step}, past --steps {rc.steps}"
            )
            raise LocalRunError(f"the run in {out} {where}; --steps N with N > {step} continues it")
        rundir.write_marker(
            out, rc.job_name
        )  # a run made before markers existed is one: its checkpoints say so
        return state
    try:  # under the run's lock (run_local): nothing removed but rlfleet's own files (rlfleet/local/rundir.py)
        rundir.check_replaceable(out, force=force)
        kept = rundir.clean(out)
    except rundir.RunDirError as exc:
        raise LocalRunError(str(exc)) from None
    if kept:
        print(f"rlfleet run: kept what rlfleet did not write in {out}: {', '.join(kept)}", file=sys.stderr)
    rundir.write_marker(out, rc.job_name)
    return None


def run_local(
    rc: RunConfig,
    out: Path,
    resume: bool = False,
    live: bool = True,
    stop: threading.Event | None = None,
    force: bool = False,
    resume_hint: str = "",
) -> dict[str, Any]:
    """Run (or resume) the local job; returns the summary written to the report. `resume_hint`: the
    command that continues the run, quoted when it fails (LocalRunError). The run holds `out`'s lock
    throughout: a second run on it is refused at once (rlfleet/local/rundir.py)."""
    try:
        if out.exists() and not out.is_dir():
            raise LocalRunError(f"--out {out} is a file, not a directory")
        if resume and not out.is_dir():
            return _run_locked(rc, out, resume, live, stop, force, resume_hint)  # nothing to resume: one line
        if not resume:  # before the lock file is made: a directory that is not a run's is left as it was
            rundir.check_replaceable(out, force=force)
        with rundir.locked(out):
            return _run_locked(rc, out, resume, live, stop, force, resume_hint)
    except rundir.RunDirError as exc:
        raise LocalRunError(str(exc)) from None


def _run_locked(
    rc: RunConfig,
    out: Path,
    resume: bool,
    live: bool,
    stop: threading.Event | None,
    force: bool,
    resume_hint: str,
) -> dict[str, Any]:
    import torch

    from rlfleet.channel import LeaseHeldError, WeightChannel
    from rlfleet.local.fleet import FleetSpec
    from rlfleet.local.fleet import GroupSpec as FleetGroup
    from rlfleet.local.report import WeightTraffic, group_tokens, lora_traffic, weight_traffic, write_report
    from rlfleet.store import open_store
    from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds
    from rlfleet.trainer.envs.prompts import PromptFileError
    from rlfleet.trainer.publish.publisher import channel_writer
    from rlfleet.trainer.run import (
        ChannelSink,
        TrainingStartError,
        build_backend,
        rollout_inputs,
        run_training,
    )
    from rlfleet.trainer.warm_start import cached_model

    stop = stop or threading.Event()
    ckpt_dir, channel_dir, report_dir = out / "checkpoints", out / "channel", out / "report"
    state = prepare_out(out, rc, resume=resume, force=force)
    channel_dir.mkdir(exist_ok=True)
    torch.manual_seed(rc.seed)
    torch.set_num_threads(1)  # the fleet host uses the other core

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run prints its own progress
    # the tiny Qwen3 checkpoint of local.model: the model source, as spec.model.path is on a cluster
    if rc.model is None:
        raise LocalRunError(
            f"{rc.job_name}: local mode trains the tiny model of the RLJob's local block (resolve_run(local=True))"
        )
    model_dir = cached_model(out / "models", rc.model)  # warm-started when local.model.warmStart says so
    try:
        base = build_backend(rc, backend="torch", source_dir=model_dir)
        env, prompts = rollout_inputs(rc, base)
    except (TrainingStartError, PromptFileError) as exc:
        raise LocalRunError(str(exc)) from None
    detector = CollapseDetector(CollapseThresholds.from_safety(rc.safety), action=rc.safety.action)
    store = open_store(str(channel_dir.resolve()))
    try:  # stable id: --resume takes over its own claims and writer lease; another run on this store is refused
        publisher = channel_writer(
            store,
            rc.views,
            publisher_id=f"local/{rc.job_name}",
            keep_versions=rc.keep_versions,
            deltas=rc.deltas,
            base_checkpoint=base.base_checkpoint,
            lora=rc.adapter_config(),  # LoRA: each version the adapter, each base view stored once
            follow_subscribers=False,  # the local fleet's views are the run's
        )
    except LeaseHeldError as exc:
        raise run_failure(exc, out, resume_hint) from None

    spec = FleetSpec(
        groups=[
            FleetGroup(
                g.name,
                g.accelerator,
                g.weight_format,
                g.kv_cache_dtype,
                quarantined=g.quarantined,
                lora=None if rc.lora is None else rc.lora.to_wire(),  # every group serves the adapters
            )
            for g in rc.groups
        ],
        store=str(channel_dir.resolve()),
        cache_dir=str((out / "cache").resolve()),
        model_path=str(model_dir),
        seed=rc.seed,
    )
    (out / "fleet.json").write_text(spec.to_json())
    (out / RUN_JSON).write_text(json.dumps({"job": rc.job_name, "config": rc.as_json()}, indent=1))

    progress = Progress(rc, live)
    traffic, reader = WeightTraffic(), WeightChannel(store, publisher_id=f"local/{rc.job_name}/report")
    rollouts = FleetRollouts(
        out,
        rc,
        base,
        env,
        prompts,
        stop,
        resume_hint,
        start_step=int(state["step"]) if state is not None else 0,
    )
    last = {"t": time.monotonic()}

    def on_step(m: dict[str, float], decision: Decision, groups: list[PromptGroup]) -> None:
        now = time.monotonic()
        m.update(group_rollout_extras(groups, now - last["t"]))
        m.update(step_economics(rc, m))
        last["t"] = now
        traffic.observe(reader)  # each version's manifest once, before retention deletes it
        progress.update(m, [a.message for a in detector.history if a.step == int(m["step"])])

    try:
        loop = run_training(
            rc,
            base.backend,
            ChannelSink(publisher),
            detector,
            rollouts.make_driver,
            checkpoint=ckpt_dir,
            resume=state,
            stop=stop,
            on_step=on_step,
            on_quarantine=rollouts.quarantine,
        )
        interrupted = stop.is_set() and loop.state.step < rc.steps
    except TrainingStartError as exc:
        raise LocalRunError(f"{exc} (in {channel_dir})") from None
    except LocalRunError:
        raise
    except Exception as exc:  # a runtime failure of trainer/failures.py: one line and its exit code
        failure = rollouts.failure(exc)
        if failure is exc:
            raise
        raise failure from None
    finally:
        progress.stop()
        fleet_death = rollouts.stop()
        traffic.observe(reader)
        publisher.close()  # also removes its copies of the last published views (the bases of its deltas)
        store.close()
    driver = rollouts.driver

    history = loop.state.history
    k = summary_window(len(history))
    summary = {
        "job": rc.job_name,
        "steps": loop.state.step,
        "target_steps": rc.steps,
        "interrupted": interrupted,
        "paused_by_detector": loop.state.paused,
        "pause_reason": loop.state.pause_reason,
        "summary_window_steps": k,
        **{
            f"{name}_{end}": window_mean(history, key, k, end)
            for name, key in SUMMARY_METRICS.items()
            for end in ("first", "last")
        },
        "collapse_alerts": [a.__dict__ for a in detector.history],
        "groups": group_tokens(history),
        "rollouts_trained": len(loop.state.trained_uids),
        "dropped_stale_groups": loop.state.dropped_stale_groups,
        "driver": driver.stats.__dict__ if driver is not None else {},
        "weights": weight_traffic(traffic.rows()),  # per view: anchors, deltas, bytes stored / complete
        "lora": lora_traffic(traffic.rows()),  # LoRA: bytes per version against full fine-tuning's
        "weight_versions": traffic.rows(),
        "seconds": time.monotonic() - progress.t0,
    }
    write_report(history, report_dir, summary)
    if fleet_death is not None and rollouts.fleet is not None:  # after the report: it holds the steps done
        when = f"at step {loop.state.step} of {rc.steps}; the checkpoint and the report ({report_dir}) hold the steps done"
        raise LocalRunError(rollouts.fleet.death_message(fleet_death, when, resume_hint), EXIT_FLEET_DIED)
    return summary


def saved_target(out: Path) -> dict[str, Any]:
    """The `steps` and `environment` a run in `out` was started with (its run.json; {} when absent):
    a resume keeps them unless the command line overrides them."""
    try:
        config = json.loads((out / RUN_JSON).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {k: config[k] for k in ("steps", "environment") if k in config}


def resume_command(args: argparse.Namespace, out: Path, rc: RunConfig) -> str:
    """The command that continues this run, runnable as printed from the same directory: the same
    program (rlfleet/cli.py `invocation`), manifest and run directory, and the run's target steps."""
    from rlfleet.cli import invocation

    words = [
        *invocation(),
        "run",
        args.manifest,
        "--local",
        "--resume",
        "--out",
        str(out),
        "--steps",
        str(rc.steps),
    ]
    if args.environment:
        words += ["--environment", rc.environment]
    if args.no_live:
        words.append("--no-live")
    return shlex.join(words)


def check_runnable(rc: RunConfig) -> None:
    """Problems of the resolved run that would otherwise surface late or as a stack trace."""
    from rlfleet.trainer.envs.prompts import GeneratedPromptSource

    if not rc.groups:
        raise LocalRunError(
            "every sampler group has replicas: 0, so nothing would generate rollouts; "
            "give at least one group replicas >= 1"
        )
    if rc.dataset in (None, "", "builtin") and rc.environment not in GeneratedPromptSource.TASKS:
        raise LocalRunError(
            f"rollout.environment {rc.environment!r} has no built-in prompts: set rollout.dataset to a prompt "
            f"file (docs/environments.md) or to builtin:<task> (one of {', '.join(GeneratedPromptSource.TASKS)})"
        )


def weights_line(view: str, w: dict[str, Any]) -> str:
    """One line of the summary per view (rlfleet/local/report.py `weight_traffic`): what the channel
    stored over the run against full versions, and the share of the view a delta stored."""
    line = (
        f"weights {view}: {w['versions']} versions ({w['anchors']} anchors, {w['deltas']} deltas), "
        f"{w['stored_bytes'] / 1e6:.2f} MB stored of {w['bytes'] / 1e6:.2f} MB as full versions "
        f"({w['stored_share']:.1%})"
    )
    if w["mean_delta_share"] is not None:
        line += f"; a delta {w['mean_delta_share']:.2%} of the view on average (worst {w['worst_delta_share']:.2%})"
    return line


def weight_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's lines on the channel's traffic: one per view, and a LoRA run's bytes per version."""
    lines = [weights_line(view, w) for view, w in summary.get("weights", {}).items()]
    return lines + ([lora_line(summary["lora"])] if summary.get("lora") else [])


def lora_line(lora: dict[str, Any]) -> str:
    """The summary's LoRA line (rlfleet/local/report.py `lora_traffic`)."""
    full = lora["full_fine_tuning_bytes_per_version"]
    ratio = f" ({1 / lora['ratio']:.0f}x less)" if lora["ratio"] else ""
    return (
        f"LoRA: each of {lora['versions']} versions stored {lora['adapter_bytes_per_version'] / 1e3:.1f} KB (the "
        f"adapter) where full fine-tuning stores {full / 1e6:.2f} MB per version (views "
        f"{', '.join(lora['base_views'])}, complete){ratio}; the base views once, {lora['base_bytes_once'] / 1e6:.2f} MB"
    )


def _print_summary(rc: RunConfig, summary: dict[str, Any], out: Path) -> None:
    first, last = summary["reward_first"], summary["reward_last"]
    k, n = summary["summary_window_steps"], summary["steps"]
    if first is None:
        print(f"{rc.job_name}: no step completed; report: {out / 'report'}")
        return
    parts = [
        f"{rc.job_name}: {n} steps in {summary['seconds']:.0f}s; mean over the first {k} steps -> the last {k}: "
        f"reward {first:.3f} -> {last:.3f}"
    ]
    for key, label in TASK_FIGURES:
        if summary.get(key + "_first") is not None:
            parts.append(f"{label} {summary[key + '_first']:.0%} -> {summary[key + '_last']:.0%}")
    if summary["entropy_first"] is not None:
        parts.append(
            f"policy entropy {summary['entropy_first']:.2f} -> {summary['entropy_last']:.2f} nats/token"
        )
    if summary.get("cost_per_1m_usable_tokens_last") is not None:
        parts.append(
            f"{_dollars(summary['cost_per_1m_usable_tokens_last'])} per 1M usable tokens at CPU speed and list prices"
        )
    if summary.get("estimated_saving_last") is not None:
        parts.append(estimated_saving_text(rc, summary["estimated_saving_last"]).removeprefix("; "))
    print("; ".join(parts) + f"; {len(summary['collapse_alerts'])} collapse alerts; report: {out / 'report'}")
    for line in weight_lines(summary):
        print(line)
    for name, g in summary.get("groups", {}).items():  # a group answering invalid tokens, by name
        if g["dropped_invalid_tokens"]:
            top = max(sorted(g["invalid_tokens"].items()), key=lambda kv: kv[1], default=("?", 0))
            print(
                f"group {name}: {g['dropped_invalid_tokens']} of its {g['sampled_tokens']} sampled tokens dropped "
                f"as invalid, {g['trained_fraction']:.1%} trained on (top reason {top[0]}: {top[1]} tokens)"
            )


def _serve_external_cli(job: Any, args: argparse.Namespace, out: Path) -> int:
    """`rlfleet run RLJOB --local --publish-dir DIR` of a job with trainer.external (rlfleet/local/external.py):
    serve as slime's rollout endpoint until Ctrl-C; bad input is one line, exit 2."""
    from rlfleet.local.external import serve_external

    if job.spec.trainer.external is None:
        print(
            f"rlfleet run: --publish-dir is for a job with trainer.external; {job.name} trains itself",
            file=sys.stderr,
        )
        return 2
    if not args.publish_dir:
        print(
            f"rlfleet run: {job.name}'s trainer is external (slime): give --publish-dir, the directory slime "
            "publishes into on this machine (its --update-weight-disk-dir); the run serves its rollouts",
            file=sys.stderr,
        )
        return 2
    if args.resume or args.steps is not None or args.environment:
        print("rlfleet run: --resume, --steps and --environment are for jobs rlfleet trains", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        served = serve_external(
            resolve_run(job, local=True), out, Path(args.publish_dir).resolve(), stop, force=args.force
        )
    except (LocalRunError, ValueError) as exc:
        print(f"rlfleet run: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.code if isinstance(exc, LocalRunError) else 2
    if served.get("fleet_died"):
        print(f"rlfleet run: the fleet host {served['fleet_died']} (see {out / FLEET_LOG})", file=sys.stderr)
        return EXIT_FLEET_DIED
    print(f"{job.name}: stopped")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet run", description="Run an RLJob manifest.")
    parser.add_argument("manifest", help="RLJob YAML (the same file `kubectl apply -f` takes)")
    parser.add_argument(
        "--local", action="store_true", help="run everything on this machine (tiny model, CPU)"
    )
    parser.add_argument(
        "--steps", type=int, help="override local.steps (with --resume: the run's own target)"
    )
    parser.add_argument("--out", help="run directory (default: ./rlfleet-runs/<job name>)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    mode.add_argument(
        "--force", action="store_true", help="replace the run in --out (its checkpoints and channel)"
    )
    parser.add_argument("--environment", help="override rollout.environment (module:attr or a built-in name)")
    parser.add_argument("--no-live", action="store_true", help="one line per step instead of the live table")
    parser.add_argument(
        "--publish-dir",
        help="a job with trainer.external (slime): the directory slime publishes its weight versions into "
        "(its --update-weight-disk-dir on this machine); the run serves as slime's rollout endpoint",
    )
    return parser


def _refused_args(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot run, before the manifest is read (None: they can)."""
    if not args.local:
        return (
            f"cluster runs are applied, not run: `kubectl apply -f {args.manifest}` (the operator "
            "runs it); add --local to run it on this machine"
        )
    if args.steps is not None and args.steps < 1:
        return "--steps must be >= 1"
    return None


def cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    refused = _refused_args(args)
    if refused:
        print(f"rlfleet run: {refused}", file=sys.stderr)
        return 2
    from rlfleet.api import load_rljob
    from rlfleet.api.rljob import RLJobLoadError

    try:
        job = load_rljob(args.manifest)
    except RLJobLoadError as exc:
        print(f"rlfleet run: {exc}", file=sys.stderr)
        return 2
    # absolute: the fleet subprocess runs with the run directory as its cwd (see the fleet start)
    out = Path(args.out or Path("rlfleet-runs") / job.name).resolve()
    if job.spec.trainer.external is not None or args.publish_dir:
        return _serve_external_cli(job, args, out)
    try:
        rc = resolve_run(
            job, local=True
        )  # refuses what only the local block decides (routingReplay, dense model)
        saved = saved_target(out) if args.resume else {}
        rc.steps = args.steps if args.steps is not None else saved.get("steps", rc.steps)
        rc.environment = args.environment or saved.get("environment", rc.environment)
        build_environment(rc)
        check_runnable(rc)
    except (LocalRunError, ValueError) as exc:
        print(f"rlfleet run: {exc}", file=sys.stderr)
        return 2
    hint = resume_command(args, out, rc)
    stop = threading.Event()
    presses = {"n": 0}

    def on_sigint(signum: int, frame: Any) -> None:
        presses["n"] += 1
        stop.set()
        if presses["n"] == 1:
            print(
                "\nstopping at the next step boundary (Ctrl-C again to stop now) ...",
                file=sys.stderr,
                flush=True,
            )
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    try:
        summary = run_local(
            rc, out, resume=args.resume, live=not args.no_live, stop=stop, force=args.force, resume_hint=hint
        )
    except LocalRunError as exc:
        print(f"rlfleet run: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"interrupted; resume with: {hint}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    _print_summary(rc, summary, out)
    if summary["interrupted"]:
        print(f"stopped early; resume with: {hint}")
        return 130
    return 0
