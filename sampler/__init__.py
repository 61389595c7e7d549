"""The sampler side: SGLang client and records, reference sampler server, weight-sync sidecar."""
