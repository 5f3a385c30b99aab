"""How many Responses WebSockets are open, in all, per client address and per managed
key (``--ws-max-connections``, ``--ws-max-connections-per-ip``, ``--key-share``): pure
counts the upgrade consults before it is accepted, and the refusal's error."""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import GatewayError

#: Seconds a client refused for too many open connections is told to wait (Retry-After).
REFUSED_RETRY_AFTER = 5


class ConnectionSlots:
    """The Responses WebSockets open in this process, at most ``limit`` at a time.

    Counted from the upgrade to the end of the connection (each holds an inbox and
    remembered conversations, whatever it does); ``on_open(count)`` / ``on_refused()``
    feed the metrics. One event loop per process: no lock needed."""

    def __init__(self, on_open: Callable[[int], None] | None = None, on_refused: Callable[[], None] | None = None) -> None:
        self.open = 0
        self.by_client: dict[str, int] = {}  # client address -> its open connections (no zero entries)
        self.by_key: dict[str, int] = {}  # managed key id -> its open connections (no zero entries)
        self._on_open = on_open or (lambda count: None)
        self._on_refused = on_refused or (lambda: None)

    def take(self, limit: int, client: str = "", per_client: int = 0, key: str = "", per_key: int = 0) -> bool:
        """A slot for one more connection, or False (counted as refused) at ``limit`` open
        in all, ``per_client`` (0: no such cap) open from ``client``, or ``per_key`` open
        with the managed key ``key`` (its ``--key-share``)."""
        if (self.open >= limit or (per_client and self.by_client.get(client, 0) >= per_client)
                or (key and per_key and self.by_key.get(key, 0) >= per_key)):
            self._on_refused()
            return False
        self.open += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        if key:
            self.by_key[key] = self.by_key.get(key, 0) + 1
        self._on_open(self.open)
        return True

    def give_back(self, client: str = "", key: str = "") -> None:
        self.open -= 1
        _less(self.by_client, client)
        if key:
            _less(self.by_key, key)
        self._on_open(self.open)


def _less(counts: dict[str, int], name: str) -> None:
    left = counts.get(name, 1) - 1
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)


def too_many_websockets(limit: int, per_client: bool = False, per_key: bool = False) -> GatewayError:
    whose = "for your API key (--key-share)" if per_key else "from your address" if per_client else "open"
    return GatewayError(
        "overloaded", "too_many_websockets",
        f"the gateway has its limit of {limit} Responses WebSocket connections {whose}: retry later"
        " (or send the request as POST /v1/responses)",
        retry_after=REFUSED_RETRY_AFTER,
    )
