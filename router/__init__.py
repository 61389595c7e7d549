"""Session-affine weighted router across sampler groups (library and HTTP service)."""
