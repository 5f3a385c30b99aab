"""Canonical stream events: what both modes emit and every protocol encoder consumes.

A mode decides *when* an event is released; an encoder decides how it looks on the wire.
Output is a sequence of *blocks* (reasoning, text, or one tool call), each opened by
:class:`BlockStart`, fed by :class:`BlockDelta` and closed by :class:`BlockStop`.
Block indexes are assigned in order of release, from 0, and never change. Encoders for
protocols that cannot interleave blocks (Messages, Responses) are only ever given one
open block at a time; the Chat encoder may see interleaved tool deltas.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import GatewayError

BlockKind = Literal["reasoning", "text", "refusal", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(slots=True)
class Usage:
    """Token usage as the upstream reported it (zeros where it did not)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    estimated: bool = False  # the upstream reported none: the gateway counted (o200k)
    # every integer detail the upstream reported (``completion_tokens_details``,
    # ``prompt_tokens_details``), kept as sent so no room drops one
    completion_details: dict[str, int] = field(default_factory=dict)
    prompt_details: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_upstream(cls, raw: dict) -> Usage:
        prompt = int(raw.get("prompt_tokens") or 0)
        completion = int(raw.get("completion_tokens") or 0)
        details = raw.get("completion_tokens_details") or {}
        prompt_details = raw.get("prompt_tokens_details") or {}
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=int(raw.get("total_tokens") or prompt + completion),
            reasoning_tokens=int(details.get("reasoning_tokens") or 0),
            cached_tokens=int(prompt_details.get("cached_tokens") or 0),
            completion_details=int_fields(details),
            prompt_details=int_fields(prompt_details),
        )


def int_fields(raw: object) -> dict[str, int]:
    """The integer-valued fields of a usage details object (anything else is dropped:
    the clients' types only have counts there)."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}


@dataclass(slots=True)
class ToolCall:
    id: str  # as the upstream sent it (or synthesized); see client_call_id
    name: str
    arguments: str
    thought_signature: str | None = None  # Gemini's, to send back with the call


RunKind = Literal["reasoning", "text", "refusal"]
#: one run of an answer: (kind, start, end) in that kind's whole text
Span = tuple[RunKind, int, int]


@dataclass(slots=True)
class Segment:
    """One run of reasoning or text, in the upstream's order (reasoning may resume after
    text: thinking, text, thinking, text are four segments)."""

    kind: RunKind
    parts: list[str]

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(slots=True)
class Completion:
    """The whole validated answer: what compatible mode replays and JSON answers show."""

    reasoning: str
    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    usage: Usage | None = None
    token_data: TokenData | None = None
    #: the runs in the upstream's order, each a (kind, start, end) range of that kind's whole
    #: text (``reasoning``, ``text`` or ``refusal``): the answer is held once, never again per
    #: run. None: one reasoning run, then one text run, then one refusal run
    spans: tuple[Span, ...] | None = None
    stop_sequence: str | None = None  # the stop string that ended it, when the upstream said
    refusal: str = ""  # what the model said as a refusal (Chat ``refusal``: structured outputs)

    def runs(self) -> list[Segment]:
        """Reasoning and text runs in the order they were produced (a run that is its
        kind's whole text is that very string, not a copy)."""
        return [Segment(kind, [source[start:end]]) for kind, source, start, end in self.run_ranges()]

    def run_ranges(self) -> Iterator[tuple[RunKind, str, int, int]]:
        """The non-empty runs in order as (kind, that kind's whole text, start, end): a
        reader can take the run a piece at a time without a copy of it."""
        sources: dict[RunKind, str] = {"reasoning": self.reasoning, "text": self.text, "refusal": self.refusal}
        order = self.spans if self.spans is not None else tuple((k, 0, len(s)) for k, s in sources.items())
        for kind, start, end in order:
            if end > start:
                yield kind, sources[kind], start, end


@dataclass(slots=True)
class TokenData:
    """What an inference engine returned about tokens (vLLM ``logprobs``,
    ``return_token_ids``), kept exactly for training-harness capture."""

    logprobs: list[dict[str, Any]] = field(default_factory=list)  # logprobs.content[] entries
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    #: MoE routing replay (vLLM ``--enable-return-routed-experts``, SGLang
    #: ``return_routed_experts``): the experts each token used, as the engine encoded them
    #: (base64 of an int32 array [tokens, layers, top_k]); for the record, never the client
    routed_experts: Any = None

    def absorb(self, chunk: dict[str, Any], choice: dict[str, Any]) -> None:
        content = (choice.get("logprobs") or {}).get("content")
        if content:
            self.logprobs.extend(content)
        ids = choice.get("token_ids")
        if ids is not None:
            self.token_ids = (self.token_ids or []) + list(ids)
        prompt = chunk.get("prompt_token_ids")
        if prompt is not None:
            self.prompt_token_ids = list(prompt)
        experts = routed_experts_of(chunk, choice)
        if experts is not None:  # the engine sends it once (the last chunk, or the JSON answer)
            self.routed_experts = experts

    def as_dict(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "token_ids": self.token_ids, "prompt_token_ids": self.prompt_token_ids,
                "routed_experts": self.routed_experts}


def routed_experts_of(chunk: dict[str, Any], choice: dict[str, Any]) -> Any:
    """An engine's ``routed_experts``, on the choice (vLLM, SGLang) or the chunk."""
    value = choice.get("routed_experts")
    return value if value is not None else chunk.get("routed_experts")


@dataclass(frozen=True, slots=True)
class BlockStart:
    index: int
    kind: BlockKind
    call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockDelta:
    index: int
    kind: BlockKind
    text: str


@dataclass(frozen=True, slots=True)
class BlockStop:
    index: int
    kind: BlockKind
    content: str  # the block's whole content (text, reasoning, or tool arguments)


@dataclass(frozen=True, slots=True)
class Finish:
    finish_reason: FinishReason
    usage: Usage | None = None
    stop_sequence: str | None = None  # which stop string matched (vLLM stop_reason, SGLang matched_stop)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The upstream's ``logprobs.content`` entries for the output released so far (Chat
    ``logprobs``); not a block event: rooms that show logprobs attach them, others ignore."""

    entries: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Error:
    error: GatewayError


@dataclass(frozen=True, slots=True)
class Keepalive:
    pass


Event = BlockStart | BlockDelta | BlockStop | Finish | TokenLogprobs | Error | Keepalive

KEEPALIVE = Keepalive()


@dataclass(slots=True)
class BlockRecord:
    """What an encoder remembers of a block it has emitted (for final objects)."""

    index: int
    kind: BlockKind
    call_id: str | None = None
    name: str | None = None
    parts: list[str] = field(default_factory=list)
