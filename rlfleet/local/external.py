"""`rlfleet run RLJOB --local --publish-dir DIR` for a job whose trainer is external (`trainer.external`,
slime; docs/slime.md): this machine serves as slime's rollout endpoint. The job's groups run as in any
local run (rlfleet/local/fleet.py: a reference engine per group at its emulated precision, each with its
weight-sync loop, behind the router), the bridge (trainer/slime_bridge.py) publishes version 0 from the
local model and then every complete `weight_v<N>` directory slime writes into DIR as version N, and the
run serves until Ctrl-C (or SIGTERM). What slime needs is printed and written to `<out>/endpoint.json`
(mode 0600): the router's URL and the key it requires (`Authorization: Bearer <key>`, which slime's
request hook adds). Nothing is trained here."""

from __future__ import annotations

import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from rlfleet.local import rundir

ENDPOINT_FILE = "endpoint.json"


def serve_external(
    rc: Any,
    out: Path,
    publish_dir: Path,
    stop: threading.Event,
    *,
    force: bool = False,
    poll_interval: float = 0.5,
) -> dict[str, Any]:
    """Serve the job's fleet for its external trainer until `stop` is set; returns what endpoint.json says.
    `rc`: the job's RunConfig (trainer/config.py resolve_run(local=True)): its groups, views, local model."""
    from rlfleet.local.main import FLEET_LOG, FleetProcess, LocalRunError, prepare_out

    if out.exists() and not out.is_dir():
        raise LocalRunError(f"--out {out} is a file, not a directory")
    if publish_dir.exists() and not publish_dir.is_dir():
        raise LocalRunError(f"--publish-dir {publish_dir} is not a directory")
    try:  # as a fresh local run: refused before the lock is made, prepared under it (rlfleet/local/rundir.py)
        rundir.check_replaceable(out, force=force)
        with rundir.locked(out):
            prepare_out(out, rc, resume=False, force=force)
            return _serve(rc, out, publish_dir, stop, poll_interval, FleetProcess, FLEET_LOG)
    except rundir.RunDirError as exc:
        raise LocalRunError(str(exc)) from None


def _serve(
    rc: Any,
    out: Path,
    publish_dir: Path,
    stop: threading.Event,
    poll_interval: float,
    fleet_process: Any,
    log: str,
) -> dict[str, Any]:
    from rlfleet.local.fleet import FleetSpec
    from rlfleet.local.fleet import GroupSpec as FleetGroup
    from rlfleet.trainer.slime_bridge import SlimeBridge, make_publisher
    from rlfleet.trainer.warm_start import cached_model

    model_dir = cached_model(
        out / "models", rc.model
    )  # the local block's model: slime's --hf-checkpoint here
    channel_dir = out / "channel"
    channel_dir.mkdir(exist_ok=True)
    publisher = make_publisher(
        str(channel_dir),
        rc.views,
        model_dir,
        keep_versions=rc.keep_versions,
        publisher_id=f"local/{rc.job_name}",
        deltas=rc.deltas,
    )
    bridge = SlimeBridge(str(publish_dir), publisher, str(model_dir))
    bridge.poll()  # version 0 (the groups start from it) and whatever slime has written already
    watching = threading.Thread(
        target=bridge.run, args=(stop, poll_interval), name="slime-bridge", daemon=True
    )
    watching.start()
    spec = FleetSpec(
        groups=[FleetGroup(g.name, g.accelerator, g.weight_format, g.kv_cache_dtype) for g in rc.groups],
        store=str(channel_dir.resolve()),
        cache_dir=str((out / "cache").resolve()),
        model_path=str(model_dir),
        seed=rc.seed,
    )
    (out / "fleet.json").write_text(spec.to_json())
    api_key = secrets.token_urlsafe(32)
    fleet = fleet_process(out / "fleet.json", out / log, secrets.token_hex(16), api_key)
    try:
        fleet.watch(stop.set)  # its death ends the serving
        urls = fleet.wait_ready()
        endpoint = {
            "router": urls["router"],
            "api_key": api_key,
            "publish_dir": str(publish_dir),
            "model": str(model_dir),
            "groups": {g.name: g.weight_format for g in rc.groups},
            "servers": urls.get("servers", {}),  # each group's engine (behind the router)
        }
        path = out / ENDPOINT_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the key: this user only
        with os.fdopen(fd, "w") as fh:
            json.dump(endpoint, fh, indent=1)
        print(
            f"{rc.job_name}: slime's rollout endpoint is {urls['router']} (--rollout-http-endpoint-url; its "
            f"request hook sends 'Authorization: Bearer <api_key of {path}>'); slime publishes into "
            f"{publish_dir} (--update-weight-transport disk --update-weight-disk-dir); base model {model_dir} "
            "(--hf-checkpoint); Ctrl-C stops",
            flush=True,
        )
        stop.wait()
        died = fleet.died()
        return {**endpoint, "fleet_died": died}
    finally:
        stop.set()
        fleet.stop()
        watching.join(timeout=30)
        publisher.close()
        publisher.channel.store.close()
