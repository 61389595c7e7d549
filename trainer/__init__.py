"""The trainer: corrected objective, advantages, metrics, the collapse detector, the training loop and the one
composition root (run.py) the cluster entrypoint, local mode (rlfleet.local) and the experiments train through,
with the CLIs (entrypoint, launch, env_try, warm_start). By concern, below them:
- `backends/`: the model compute the loop drives (`torch`: backend_hf, `megatron`: backend_megatron and its
  megatron_* parts), what both share (backend_common), and what only they use (packed attention, MoE routing
  metrics, routing replay);
- `rollout/`: prompts -> sessions through the router -> prompt groups (driver), and prompt groups -> the
  training batch (batching);
- `envs/`: the task: prompt sources, the environments, the SWE environment (its sandboxes, grading, task files);
- `publish/`: what the trainer writes next to the weight channel: the weight versions (publisher) and the
  checkpoints.
Imports go down that list (backends -> rollout -> envs; backends -> publish), never up: an import-linter
contract in pyproject.toml."""
