"""The trainer: corrected objective, advantages, metrics, async rollout driver, backends, and the one
composition root (run.py) the cluster entrypoint, local mode (rlfleet.local) and the experiments train through."""
