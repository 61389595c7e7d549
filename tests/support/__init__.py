"""What the test files share, one copy of each, by job (issue 41 item 3).

tests/ is on sys.path under pytest (tests/conftest.py sits in it and tests/ is no package), so a test file
imports `from support.ports import free_port`; a script that runs alone puts tests/ on sys.path first
(tests/cluster/controlplane.py) or loads the module by path (tests/gpu/gpu_check.py). Not test files:
pytest collects nothing here.

- ports: a free 127.0.0.1 port
- waits: polling until a condition holds (blocking `wait_for`, asyncio `eventually`)
- processes: child processes (dying with the test, stopped at teardown, `rlfleet operator run`,
  `rlfleet trainer run`)
- upstreams: real HTTP upstreams speaking SGLang's API subset to the router; `serving(app)` for any
  aiohttp fake
- router_bench: the router service in front of upstreams with a client (`router_bench()`), and
  concurrent sessions through it (`sessions_load`)
- moto: a real S3-compatible server (moto_server) and its buckets
- fake_prometheus: a real Prometheus-API server answering the rebalancer's query
- fake_kube: the operator's KubeApi over a dict, for the handlers without a cluster
- control_plane: rlfleet on the test control plane (CRDs, the operator in process, RLJobs, Events,
  a spot node, fresh namespaces, ServiceAccounts of given rules, the sandbox grants by `bind`, what a Role grants)
- cluster_modules: tests/cluster/*.py loaded by path for pytest's side
- manifests: RLJob, standalone SamplerGroup and Pod manifests as plain dicts, a Role and its binding
- example_children: what the operator's builders make for examples/rljob.yaml
- claim_window: a real trainer SIGKILLed inside its claim window
- invalid_rljobs: tests/api/invalid_rljobs.yaml's cases applied to the example
- tiny_models: the tiny Qwen3 sizes the tests train (LOOP_MODEL) and serve (SERVED_MODEL) at
- weight_sync: the weight-sync sidecar in process with no engine behind it, and its `--fetch-only` CLI
- sglang_launches: the catalog's SGLang launches of model m, the quantization a checkpoint declares and a
  launch asks for, an argv-printing stand-in for the engine program
- reference_serve: `rlfleet sampler serve --engine reference`'s arguments
- fleet_plan_cli: `rlfleet fleet plan FILE` as a subprocess
- autopilot_readings: the precision autopilot's reading of one group within its budgets
- env_try: `rlfleet env try --environment swe` as a subprocess
- scripted_turns: the SampledTurns a stand-in sampler answers with (q known exactly)
- rollout_drivers: `make_driver(position)` for run_training over a sampler of the test's own
- gqa_sizes: the tiny two-layer grouped-query model the backend and attention tests build
- hf_backend_steps: the transformers backend's tests' models, batches, backend on CPU, one step, gloo
  processes
- episode_outcomes: EpisodeOutcomes of episodes that ended as planned
- stub_views: directories standing for a version's published views (a config.json naming each)
- operator_chart: charts/rlfleet installed with helm on the dev cluster (the operator from a loaded image)
"""
