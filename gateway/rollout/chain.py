"""Which calls of a rollout extend each other token for token: pure, fed call records.

A call *extends* an earlier one when its ``prompt_ids`` start with that call's
``prompt_ids + completion_ids``. For each call :class:`RolloutChain` picks, among the
earlier calls with token ids, the one whose sequence shares the longest prefix with this
prompt (the latest on a tie), or the call it extends exactly when that one explains the
prompt as well (see :meth:`RolloutChain.previous`), so a side call (a title request, a sub-agent) does not break
the main chain: the next main call still extends the last main one. ``continuity`` then
says ``exact`` (it extends that call), ``diverged`` (the first differing position) or
``unknown`` (this call has no token ids). The first call with ids has no previous call
and is ``exact`` (nothing to extend).

A *segment* of the trajectory is a maximal chain of calls each extending the previous
exactly: its ``tokens`` are the last call's prompt + completion, ``mask`` is 1 on every
token some call of the chain sampled, ``logprobs`` the sampled logprobs there (``None``
where the mask is 0), ``weight_versions`` each call's versions with ``from_token`` as a
position in ``tokens`` (its prompt's length + the call's own ``from_token``). A call that extends a call inside another segment (a fork) starts a
new segment holding that chain's calls up to the one it extends.

Reused by token-in continuation (issue #27): :meth:`RolloutChain.previous` answers the
call a new prompt would extend, and where it diverges.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class Continuity:
    previous_call_id: str | None
    prefix: str  # "exact" | "diverged" | "unknown"
    diverged_at: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"previous_call_id": self.previous_call_id, "prefix": self.prefix, "diverged_at": self.diverged_at}


@dataclass(slots=True)
class _Call:
    call_id: str
    prompt: list[int]
    completion: list[int]
    logprobs: list[float | None]
    versions: list[dict[str, Any]] = field(default_factory=list)  # the record's weight_versions

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.completion


def _tokens_of(record: dict[str, Any]) -> _Call | None:
    tokens = record.get("tokens")
    if not isinstance(tokens, dict) or tokens.get("prompt_ids") is None or tokens.get("completion_ids") is None:
        return None
    completion = list(tokens["completion_ids"])
    logprobs = list(tokens.get("completion_logprobs") or [None] * len(completion))
    versions = [v for v in record.get("weight_versions") or [] if isinstance(v, dict)]
    return _Call(str(record["call_id"]), list(tokens["prompt_ids"]), completion, logprobs, versions)


@dataclass
class RolloutChain:
    """Fed call records in call order (``add``); answers continuity and segments."""

    _calls: list[_Call] = field(default_factory=list)
    #: each segment: the indexes of its calls, in order
    _segments: list[list[int]] = field(default_factory=list)
    _tail_of: dict[int, int] = field(default_factory=dict)  # call index -> segment it ends
    _continuity: dict[str, Continuity] = field(default_factory=dict)
    #: (call id, the call it extends) for each call extending a call that another call
    #: already extended: the trajectory branches there
    forks: list[tuple[str, str]] = field(default_factory=list)

    def previous(self, prompt: Sequence[int]) -> tuple[int | None, int]:
        """The earlier call ``prompt`` should extend (its index, or None when there is no
        earlier call with ids) and the length of their common prefix.

        The call sharing the longest prefix with ``prompt`` (the latest on a tie), unless
        a call that ``prompt`` extends exactly explains the prompt as well: that one's
        sequence reaches as far as the shared prefix does, or the prompt lies wholly
        inside the other call's sequence (a retry from an earlier point, not an edit)."""
        best, best_len = None, -1
        exact, exact_len = None, -1
        for i, call in enumerate(self._calls):
            sequence = call.sequence
            common = _common_prefix(sequence, prompt)
            if common >= best_len:
                best, best_len = i, common
            if common == len(sequence) and common >= exact_len:
                exact, exact_len = i, common
        if exact is not None and (best_len <= exact_len or best_len == len(prompt)):
            return exact, exact_len
        return best, max(best_len, 0)

    def add(self, record: dict[str, Any]) -> Continuity:
        """One more call (in call order): its continuity, and the segments updated."""
        call = _tokens_of(record)
        if call is None:
            result = Continuity(None, "unknown", None)
            self._continuity[str(record.get("call_id"))] = result
            return result
        index, common = self.previous(call.prompt)
        me = len(self._calls)
        self._calls.append(call)
        if index is None:
            result = Continuity(None, "exact", None)
        elif common == len(self._calls[index].sequence):
            result = Continuity(self._calls[index].call_id, "exact", None)
        else:
            result = Continuity(self._calls[index].call_id, "diverged", common)
        self._continuity[call.call_id] = result
        if result.prefix == "exact" and index is not None:
            segment = self._tail_of.pop(index, None)
            if segment is None:  # a fork: the chain up to the call it extends, then this one
                self.forks.append((call.call_id, self._calls[index].call_id))
                source = next(s for s in self._segments if index in s)
                self._segments.append(source[: source.index(index) + 1] + [me])
                segment = len(self._segments) - 1
            else:
                self._segments[segment].append(me)
        else:
            self._segments.append([me])
            segment = len(self._segments) - 1
        self._tail_of[me] = segment
        return result

    def continuity(self, call_id: str) -> Continuity | None:
        return self._continuity.get(call_id)

    def segments(self) -> list[dict[str, Any]]:
        out = []
        for members in self._segments:
            calls = [self._calls[i] for i in members]
            last = calls[-1]
            tokens = last.sequence
            mask = [0] * len(tokens)
            logprobs: list[float | None] = [None] * len(tokens)
            for call in calls:
                start = len(call.prompt)
                for k, lp in enumerate(call.logprobs[: len(call.completion)]):
                    mask[start + k] = 1
                    logprobs[start + k] = lp
                for k in range(len(call.logprobs), len(call.completion)):
                    mask[start + k] = 1
            versions = [{"call_id": c.call_id, "version": v.get("version"),
                         "from_token": len(c.prompt) + int(v.get("from_token") or 0)} for c in calls for v in c.versions]
            out.append({"call_ids": [c.call_id for c in calls], "tokens": tokens, "mask": mask, "logprobs": logprobs,
                        "weight_versions": versions})
        return out


def chain_of(records: Iterable[dict[str, Any]]) -> RolloutChain:
    chain = RolloutChain()
    for record in records:
        chain.add(record)
    return chain


# -- token-in continuation (issue #27) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenInPlan:
    """The decision for one call: ``status`` is ``used`` (send the engine ``prefix_ids``
    then the engine's rendering of the new messages) or ``skipped: <reason>``."""

    status: str
    previous_call_id: str | None = None
    #: the previous call's prompt_ids + completion_ids, exactly as sampled
    prefix_ids: tuple[int, ...] = ()
    #: the previous call's messages, then its answer as an empty assistant turn, then the
    #: new messages: what the engine's template renders to find the suffix's tokens
    render_messages: tuple[dict[str, Any], ...] = ()
    #: the previous call's prompt ids (the rendering must start with them)
    previous_prompt: tuple[int, ...] = ()

    @property
    def used(self) -> bool:
        return self.status == "used"


def _skipped(reason: str, previous: str | None = None) -> TokenInPlan:
    return TokenInPlan("skipped: " + reason, previous)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [((c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments")))
            for c in message.get("tool_calls") or [] if isinstance(c, dict)]


def answer_matches(message: dict[str, Any], answer: dict[str, Any]) -> bool:
    """The client's assistant turn is the previous call's answer: the same text (up to
    surrounding white space) and the same tool calls (names, arguments as JSON values),
    whatever ids, spacing or reasoning the client kept."""
    if message.get("role") != "assistant":
        return False
    calls = [(c.get("name"), _arguments(c.get("arguments"))) for c in answer.get("tool_calls") or []]
    return _text(message.get("content")).strip() == str(answer.get("text") or "").strip() and _calls(message) == calls


_SYSTEM = ("system", "developer")


def _why_not(previous: dict[str, Any], body: dict[str, Any]) -> str | None:
    """Why ``body`` does not extend ``previous``'s call, or None when it does."""
    sent = previous.get("upstream_request") or {}
    old, new = list(sent.get("messages") or []), list(body.get("messages") or [])
    if (sent.get("tools") or None) != (body.get("tools") or None):
        return "tools_changed"
    if [m for m in old if m.get("role") in _SYSTEM][:1] != [m for m in new if m.get("role") in _SYSTEM][:1]:
        return "system_changed"
    if old and old[-1].get("role") == "assistant":
        return "previous_prefill"
    if len(new) < len(old):  # compaction, a summary, a shortened history
        return "history_truncated"
    if new[: len(old)] != old:
        return "history_edited"
    if len(new) < len(old) + 2:
        return "no_new_messages"
    if not answer_matches(new[len(old)], previous.get("answer") or {}):
        return "answer_changed"
    rest = new[len(old) + 1 :]
    if rest[-1].get("role") == "assistant":
        return "prefill"
    return None


def _has_tokens(record: dict[str, Any]) -> bool:
    tokens = record.get("tokens")
    return isinstance(tokens, dict) and tokens.get("prompt_ids") is not None and tokens.get("completion_ids") is not None


def continuation(history: Sequence[dict[str, Any]], body: dict[str, Any]) -> TokenInPlan:
    """Token-in for a call with chat ``body``, given its rollout's earlier records (any
    order): the latest successful call with token ids that ``body`` extends (its messages
    unchanged, its answer as the next assistant turn, then new messages, same system and
    tools) is continued; otherwise ``skipped`` with the reason the latest such call gave
    (``first_turn`` when there is none)."""
    candidates = sorted(
        (r for r in history if r.get("outcome") == "success" and _has_tokens(r)
         and isinstance(r.get("upstream_request"), dict) and isinstance(r.get("answer"), dict)),
        key=lambda r: (float(r.get("started_at") or 0), int(r.get("seq") or 0)), reverse=True,
    )
    if not candidates:
        return _skipped("first_turn")
    reason = None
    for record in candidates:
        why = _why_not(record, body)
        if why is None:
            call = _tokens_of(record)
            assert call is not None
            old = list(record["upstream_request"].get("messages") or [])
            new = list(body.get("messages") or [])
            rendered = (*old, {"role": "assistant", "content": ""}, *new[len(old) + 1 :])
            return TokenInPlan("used", call.call_id, tuple(call.sequence), rendered, tuple(call.prompt))
        reason = reason or why
    return _skipped(reason or "first_turn", str(candidates[0].get("call_id")))


def splice(plan: TokenInPlan, rendered: Sequence[int], last_sampled: int | None) -> list[int] | str:
    """The token-id prompt: the previous prompt + completion exactly, then what the
    engine's rendering of ``plan.render_messages`` (with the generation prompt) adds after
    the previous prompt: the empty assistant turn's closing tokens and the new messages.
    A closing token the previous completion already sampled (its end-of-turn) is not
    repeated. A reason string when the rendering does not start with the previous prompt
    (the template is not append-only there)."""
    prompt = list(plan.previous_prompt)
    if list(rendered[: len(prompt)]) != prompt:
        return "template_not_append_only"
    rest = list(rendered[len(prompt) :])
    if rest and last_sampled is not None and rest[0] == last_sampled:
        rest = rest[1:]
    return list(plan.prefix_ids) + rest
