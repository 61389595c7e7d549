"""What a store raises: one base class, so callers catch `StoreError` and tell "absent" from
"unreachable, retry later" by subclass."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of store errors."""


class KeyNotFoundError(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "key not found"


class StoreUnavailableError(StoreError):
    """The store could not be reached (network, endpoint down, volume missing). Retry later."""


class ObjectTooLargeError(StoreError):
    """`get(key, max_bytes=N)`: the object holds more than N bytes (none of them are returned)."""
