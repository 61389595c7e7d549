"""Pydantic v2 models of the custom resources: the single source of truth for the CRDs."""
