"""Routed experts stored compactly (issue #37, docs/capture.md "Routed experts"): an agent
rollout of 10 chained calls (each adds 500 tokens of tool results and samples 500), with
MoE routing the size of a 48-layer top-8 model (int32 [tokens, 48, 8]: 1.5 KiB per token,
random bytes standing in), through :func:`gateway.rollout.experts.compacted` as the
recorder applies it: base64 bytes stored whole vs cut to each call's new tokens, and the
slowest cut (it runs in the recorder's worker thread, never on the event loop).

``python bench/routed_experts.py`` prints one JSON object.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.rollout.experts import compacted  # noqa: E402

LAYERS, TOP_K, CALLS, TURN = 48, 8, 10, 500
STRIDE = LAYERS * TOP_K * 4


def record(n: int, prompt: list[int], completion: list[int]) -> dict[str, Any]:
    data = os.urandom((len(prompt) + len(completion)) * STRIDE)
    return {"call_id": f"c{n}", "started_at": float(n), "routed_experts": base64.b64encode(data).decode(),
            "tokens": {"prompt_ids": prompt, "completion_ids": completion, "completion_logprobs": [0.0] * len(completion)}}


def main() -> None:
    history: list[dict[str, Any]] = []
    sequence = list(range(TURN))
    whole = stored = 0
    slowest = 0.0
    for n in range(CALLS):
        prompt = sequence + list(range(10**6 + n * TURN, 10**6 + (n + 1) * TURN))  # tool results
        completion = list(range(2 * 10**6 + n * TURN, 2 * 10**6 + (n + 1) * TURN))
        raw = record(n, prompt, completion)
        whole += len(raw["routed_experts"])
        started = time.perf_counter()
        cut = compacted(raw, history)
        slowest = max(slowest, time.perf_counter() - started)
        stored += len(cut["routed_experts"])
        history.append(cut)
        sequence = prompt + completion
    print(json.dumps({"calls": CALLS, "final_tokens": len(sequence), "whole_mib": round(whole / 2**20, 1),
                      "compact_mib": round(stored / 2**20, 1), "slowest_cut_ms": round(slowest * 1000, 1)}))


if __name__ == "__main__":
    main()
