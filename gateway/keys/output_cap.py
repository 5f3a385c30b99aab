"""The output cap of a key with token limits is the gateway's (pure: no I/O).

Upstream engines read the length of an answer from fields of their own: llama.cpp's
``n_predict``, TGI's and SGLang's ``max_new_tokens``, next to OpenAI's ``max_tokens`` /
``max_completion_tokens``; and ``min_tokens`` / ``min_new_tokens`` (vLLM, SGLang) force a
length. A client could send ``max_tokens: 5`` (reserved) beside ``n_predict: 30000``
(obeyed). So the cap a request asks for is the smallest length it names in any of these
fields, and the body that goes upstream carries the granted cap in every length field
the client sent (and ``max_tokens`` always; ``n_predict`` too when the body speaks
llama.cpp), with the floors clamped to it: whichever field the engine reads, it cannot
generate past what was reserved. ``ignore_eos`` stays: it cannot pass the cap either.
"""

from __future__ import annotations

from typing import Any

#: Fields that set the longest answer, in the engines that read them.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens")
#: Fields that set the shortest answer: clamped to the cap.
FLOOR_FIELDS = ("min_tokens", "min_new_tokens")
#: Fields only llama.cpp's server reads: a body with one of them gets ``n_predict`` too.
LLAMA_CPP_FIELDS = frozenset({
    "n_predict", "n_keep", "n_probs", "cache_prompt", "id_slot", "samplers", "grammar", "mirostat",
    "mirostat_tau", "mirostat_eta", "repeat_penalty", "repeat_last_n", "penalize_nl", "typical_p", "tfs_z",
    "dynatemp_range", "dynatemp_exponent", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "t_max_predict_ms", "n_indent",
    "post_sampling_probs", "return_tokens",
})


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def requested_cap(body: dict[str, Any]) -> int | None:
    """The smallest output length the body names (None: it names none; ``n_predict: -1``,
    llama.cpp's "no limit", names none)."""
    named = [n for n in (_count(body.get(f)) for f in LENGTH_FIELDS) if n is not None]
    return min(named) if named else None


def answers_of(body: dict[str, Any], protocol: str) -> int:
    """How many answers one request may generate: a text completion's ``n`` / ``best_of``
    (each up to the cap; Chat refuses ``n > 1`` at parse time)."""
    if protocol != "completions":
        return 1
    return max(_count(body.get("n")) or 1, _count(body.get("best_of")) or 1)


def capped(body: dict[str, Any], cap: int) -> dict[str, Any]:
    """The body with ``cap`` in every length field it sent (``max_tokens`` when it sent
    none of OpenAI's two; ``n_predict`` when it speaks llama.cpp) and its floors at most
    ``cap``."""
    out = dict(body)
    for name in LENGTH_FIELDS:
        if name in out:
            out[name] = cap
    if "max_tokens" not in out and "max_completion_tokens" not in out:
        out["max_tokens"] = cap
    if LLAMA_CPP_FIELDS & out.keys():
        out["n_predict"] = cap
    for name in FLOOR_FIELDS:
        if name in out:
            floor = _count(out.pop(name))
            if floor is not None:  # anything else is no floor an engine could keep: dropped
                out[name] = min(floor, cap)
    return out
