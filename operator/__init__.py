"""The Kubernetes operator (kopf): thin handlers, pure builders, pure status computation."""
