"""Rollouts: the asynchronous driver (driver.py: prompts -> sessions through the router -> scored prompt
groups) and the step's batch built from them (batching.py: prompt groups -> one row per sampled token)."""
