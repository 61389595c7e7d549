"""Shared pytest configuration. Area fixtures live next to their tests; the real control plane
fixture (`kube`) lives in tests/cluster/ and is re-exported here so every area can use it."""
