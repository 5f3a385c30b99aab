"""Managed client keys (issue #28): one key per user or team, with its own models, rate
limits, token budget and usage.

``model`` (the key and its limits, pure), ``store`` (the tables of migration 10 and the
atomic reservations), ``registry`` (the keys in memory, refreshed from the store: the
request path never waits on it to authenticate), ``limiter`` (reserve before going
upstream, settle at the end, fail closed), ``admin`` (the admin API).
"""

from gateway.keys.model import KEY_PREFIX, KeyLimits, ManagedKey
from gateway.keys.registry import KeyRegistry, managed_key

__all__ = ["KEY_PREFIX", "KeyLimits", "KeyRegistry", "ManagedKey", "managed_key"]
