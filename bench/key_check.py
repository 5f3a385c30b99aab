"""What a managed client key costs per request (issue #28), in CPU, no servers: the
in-memory check (hash lookup, revoked/expired, model globs) against a static ``--api-key``
compare, and a key with limits' reservation + settlement in a real SQLite store (WAL, in
a temp dir), called directly and through ``asyncio.to_thread`` as the request path does.

``python bench/key_check.py`` prints one JSON object; ``bench/run.py`` (``make bench``)
adds it to its results as ``key_check``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from starlette.requests import Request  # noqa: E402

from gateway.keys import store  # noqa: E402
from gateway.keys.identity import check_client_key  # noqa: E402
from gateway.keys.model import KeyLimits, ManagedKey, hash_secret, new_key_id, new_secret  # noqa: E402
from gateway.keys.registry import KeyRegistry  # noqa: E402
from gateway.store.db import Database  # noqa: E402

KEYS = 1000  # keys in the registry


def _request(secret: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": [(b"authorization", f"Bearer {secret}".encode())]})


def _cpu_us(fn: Any, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def run_all(n: int = 20000, store_n: int = 2000) -> dict[str, float]:
    from pydantic import SecretStr

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cb2a-keys-") as tmp:
        db = Database(Path(tmp) / "keys.sqlite3")
        registry = KeyRegistry(db)
        keys, secret = [], ""
        for i in range(KEYS):
            secret = new_secret()
            limits = KeyLimits(models=("gpt-4o*", "claude-*", "text"), rpm=60, daily_tokens=10**12)
            keys.append(ManagedKey(new_key_id(), f"k{i}", secret[:12], hash_secret(secret), limits, time.time()))
        registry.replace(keys)
        key = keys[-1]
        static = [SecretStr("ck-static-client-key-0123456789abcdef")]
        static_request = _request(static[0].get_secret_value())
        out["static_key_check_us"] = round(_cpu_us(lambda: check_client_key(static_request, static), n), 2)

        def managed() -> None:
            request = _request(secret)
            check_client_key(request, [], registry)
            key.check_model("claude-sonnet-4")

        def baseline() -> None:
            _request(secret)

        out["managed_key_check_us"] = round(_cpu_us(managed, n) - _cpu_us(baseline, n), 2)
        ids = iter(range(10**9))
        budget_only = ManagedKey(new_key_id(), "budget", "sk-cb2a-xxxx", "0" * 64,
                                 KeyLimits(daily_tokens=10**12), time.time())
        store.insert(db, budget_only)

        def reserve_settle(which: ManagedKey = budget_only) -> None:
            request_id = f"req_{next(ids)}"
            assert store.reserve(db, which, request_id, 133) is None
            store.settle(db, request_id, 27)

        out["reserve_settle_sqlite_us"] = round(_cpu_us(reserve_settle, store_n), 1)
        # rpm 60 + tpm + daily + max_concurrent, each key's minute filled to its rpm
        full: list[float] = []
        for i in range(store_n // 60):
            rated = ManagedKey(new_key_id(), f"rated{i}", "sk-cb2a-xxxx", f"{i + 1:064d}",
                               KeyLimits(rpm=60, tpm=10**9, max_concurrent=100, daily_tokens=10**12), time.time())
            store.insert(db, rated)
            full.append(_cpu_us(lambda: reserve_settle(rated), 60))
        out["reserve_settle_sqlite_rpm60_us"] = round(sum(full) / len(full), 1)

        async def threaded() -> float:
            start = time.process_time()
            for _ in range(store_n):
                request_id = f"req_{next(ids)}"
                await asyncio.to_thread(store.reserve, db, budget_only, request_id, 133)
                await asyncio.to_thread(store.settle, db, request_id, 27)
            return (time.process_time() - start) / store_n * 1e6

        out["reserve_settle_sqlite_threaded_us"] = round(asyncio.run(threaded()), 1)
        db.close()
    out["registry_keys"] = KEYS
    return out


if __name__ == "__main__":
    print(json.dumps(run_all(), indent=1))
