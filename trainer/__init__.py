"""The trainer: corrected objective, advantages, metrics, async rollout driver, backends."""
