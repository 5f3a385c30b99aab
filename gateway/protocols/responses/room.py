"""OpenAI Responses: the room (parse, stored-state hooks), JSON answers, errors (the
``GET /v1/responses/{id}`` endpoint is in gateway/routes/generation.py; the stream encoder and the
Response object's item helpers, shared with the JSON answer, are in responses_encoder.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.base import ParsedRequest, load_json_object
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.openai_shapes import assistant_message, error_json
from gateway.protocols.responses.compaction import (
    compacted_response,
    compaction_item,
    summary_message,
)
from gateway.protocols.responses.encoder import ResponsesEncoder
from gateway.protocols.responses.items import (
    message_item,
    new_id,
    output_logprobs,
    reasoning_item,
    response_object,
    terminal_status,
    tool_call_item,
    usage_object,
)
from gateway.protocols.responses.tools import ToolMap
from gateway.protocols.responses.translate import Translation, translate
from gateway.stream.events import Completion

log = structlog.get_logger("gateway.responses")

_TRUNCATION = ("auto", "disabled")


def _echo(raw: dict[str, Any], body: Any) -> dict[str, Any]:
    """The request fields every Response object of this request repeats."""
    tools = []
    for tool in body.tools or []:
        if tool.get("type") == "namespace" and not isinstance(tool.get("description"), str):
            tool = {**tool, "description": ""}  # required by the SDK's NamespaceTool model
        tools.append(tool)
    reasoning = None
    if body.reasoning is not None:
        reasoning = {k: body.reasoning.get(k) for k in ("effort", "summary")}
    truncation = raw.get("truncation")
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": body.model,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": raw.get("prompt_cache_key")
        if isinstance(raw.get("prompt_cache_key"), str)
        else None,
        "reasoning": reasoning,
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": body.text if body.text is not None else {"format": {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": tools,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "truncation": truncation if truncation in _TRUNCATION else "disabled",
        "user": body.user,
    }


#: JSON answers built but not yet asked for twice (json_body and completed); a bound, not a cache.
_BUILT_KEPT = 256


@dataclass(frozen=True, slots=True)
class ResponsesFacts:
    """What the Responses encoder, JSON answer and store need beyond the upstream body."""

    echo: dict[str, Any]  # the request fields the Response object repeats
    tool_map: ToolMap  # upstream tool name -> (client name, namespace)
    envelope: bool  # include reasoning.encrypted_content
    store: bool
    previous_response_id: str | None
    instructions_count: int  # leading system messages (stored history goes after them)
    history: tuple[dict[str, Any], ...]  # chat messages before this turn's output
    dropped_tools: tuple[str, ...] = ()
    resolved: bool = False  # previous_response_id already prepended
    compaction: bool = False  # a compaction turn: the answer is one compaction item
    logprobs: bool = False  # include message.output_text.logprobs


class ResponseStorage(Protocol):
    """Where stored responses live (``gateway.store.responses.ResponseStore``; tests may
    pass a dict-backed one). ``owner``: the client identity (gateway/keys/identity.py) a record
    belongs to; ``load`` answers None to anyone else, as for an unknown id."""

    async def save(self, response_id: str, record: dict[str, Any], owner: str) -> None: ...

    async def load(self, response_id: str, owner: str) -> dict[str, Any] | None: ...


class ResponsesRoom:
    """The ``/v1/responses`` protocol room."""

    name = "responses"
    sequential_blocks = True

    def __init__(self, store: ResponseStorage) -> None:
        self.store = store
        self._built: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[ResponsesFacts]:
        raw = load_json_object(body)
        return self._parsed(raw, translate(raw, tenant=tenant), tenant)

    def _parsed(self, raw: dict[str, Any], t: Translation, tenant: Tenant) -> ParsedRequest[ResponsesFacts]:
        return ParsedRequest(
            tenant=tenant,
            protocol=self.name,
            model=t.body.model,
            stream=t.body.stream,
            upstream_body=t.upstream,
            rules=t.rules,
            facts=ResponsesFacts(
                echo=_echo(raw, t.body),
                tool_map=t.tool_map,
                envelope=t.include_reasoning_envelope,
                store=t.body.store is not False,
                previous_response_id=t.body.previous_response_id,
                instructions_count=t.instructions_count,
                history=tuple(t.input_messages),
                dropped_tools=tuple(t.dropped_tools),
                compaction=t.compaction,
                logprobs=t.include_logprobs,
            ),
        )

    def new_response_id(self) -> str:
        return new_id("resp_")

    async def resolve(self, request: ParsedRequest[ResponsesFacts]) -> ParsedRequest[ResponsesFacts]:
        """A new request with the stored response's conversation (input, then output)
        prepended; the parsed one is left as it was."""
        facts = request.facts
        previous = facts.previous_response_id
        if not previous or facts.resolved:
            return request
        record = await self.load_conversation(previous, request.tenant.identity)
        if record is None:  # unknown, or another client key's: the same answer
            raise invalid_request(
                f"previous response {previous!r} was not found"
                " (it may have been sent with store: false)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        prior = list(record.get("history") or []) + list(record.get("output") or [])
        at = facts.instructions_count
        messages = request.upstream_body["messages"]
        upstream_body = {**request.upstream_body, "messages": messages[:at] + prior + messages[at:]}
        facts = dataclasses.replace(facts, history=(*prior, *facts.history), resolved=True)
        return dataclasses.replace(request, upstream_body=upstream_body, facts=facts)

    async def completed(
        self, request: ParsedRequest[ResponsesFacts], response_id: str, completion: Completion, encoder: object
    ) -> None:
        """Store the answer (``store: true``): the streamed final object, or the JSON one."""
        if isinstance(encoder, ResponsesEncoder) and encoder.final is not None:
            final = encoder.final
        else:
            final = self._final(request, response_id, completion)
        record = self.stored_record(request, final, completion)
        await self.keep(response_id, record, request.facts.store, request.tenant.identity)

    @staticmethod
    def stored_record(
        request: ParsedRequest[ResponsesFacts], final: dict[str, Any], completion: Completion
    ) -> dict[str, Any]:
        """What a later ``previous_response_id`` continues from (upstream messages); after
        a compaction turn, the summary alone."""
        if request.facts.compaction:
            return {"response": final, "history": [], "output": [summary_message(completion.text)]}
        return {
            "response": final,
            "history": list(request.facts.history),
            "output": [assistant_message(completion)],
        }

    async def load_conversation(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The stored record a ``previous_response_id`` names (None: unknown, or not
        ``owner``'s)."""
        return await self.store.load(response_id, owner)

    async def keep(self, response_id: str, record: dict[str, Any], store: bool | None, owner: str) -> None:
        """Keep a finished response for later turns (here: only with ``store``), as
        ``owner``'s."""
        if not store:
            return
        try:
            await self.store.save(response_id, record, owner)
        except Exception:  # the answer was delivered; a failed save must not turn it into an error
            log.exception("response_store_failed", response_id=response_id)

    def encoder(self, request: ParsedRequest[ResponsesFacts], response_id: str) -> ResponsesEncoder:
        facts = request.facts
        return ResponsesEncoder(
            response_id,
            echo=facts.echo,
            tool_map=facts.tool_map,
            envelope=facts.envelope,
            compaction=facts.compaction,
            tenant=request.tenant,
            logprobs=facts.logprobs,
        )

    def json_body(self, request: ParsedRequest[ResponsesFacts], response_id: str, completion: Completion) -> dict:
        return self._final(request, response_id, completion)

    def _final(self, request: ParsedRequest[ResponsesFacts], response_id: str, completion: Completion) -> dict[str, Any]:
        """The JSON answer, built once per response whichever of ``json_body`` and
        ``completed`` asks first (so the stored object is the one the client got)."""
        built = self._built.pop(response_id, None)
        if built is not None:
            return built
        built = self._build(request, response_id, completion)
        self._built[response_id] = built
        while len(self._built) > _BUILT_KEPT:
            self._built.popitem(last=False)
        return built

    def _build(
        self, request: ParsedRequest[ResponsesFacts], response_id: str, completion: Completion
    ) -> dict[str, Any]:
        """The JSON answer: reasoning item, message item, tool call items (a compaction
        turn: one compaction item)."""
        facts = request.facts
        output: list[dict[str, Any]] = []
        if facts.compaction:
            output.append(compaction_item(completion.text, request.tenant))
        else:
            logprobs = output_logprobs(completion) if facts.logprobs else []
            for run in completion.runs():  # reasoning and message items in the upstream's order
                if run.kind == "reasoning":
                    output.append(reasoning_item(new_id("rs_"), run.text, request.tenant if facts.envelope else None))
                else:
                    refusal = run.kind == "refusal"
                    output.append(message_item(new_id("msg_"), run.text, "completed", refusal, logprobs))
                    logprobs = logprobs if refusal else []  # all on the first text part, as streamed
        for call in completion.tool_calls:
            item_id = new_id("fc_" if call.name not in facts.tool_map.kinds else "ctc_")
            output.append(
                tool_call_item(facts.tool_map, item_id, call.id, call.name, call.arguments, "completed")
            )
        status, reason = terminal_status(completion.finish_reason)
        return response_object(
            facts.echo,
            response_id,
            int(time.time()),
            status,
            output,
            usage=usage_object(completion.usage),
            incomplete_reason=reason,
        )

    def error_body(self, error: GatewayError) -> dict:
        return error_json(error)

    def compact_room(self) -> ResponsesCompactRoom:
        return ResponsesCompactRoom(self.store)


class ResponsesCompactRoom(ResponsesRoom):
    """``POST /v1/responses/compact``: ``model``, ``input``, ``instructions`` in; the
    compacted item list (one compaction item) out, as a ``response.compaction`` object.
    Always a JSON answer; nothing is stored."""

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[ResponsesFacts]:
        raw = load_json_object(body)
        raw.pop("stream", None)  # not part of this endpoint: always one JSON answer
        parsed = self._parsed(raw, translate(raw, compaction=True, tenant=tenant), tenant)
        return dataclasses.replace(parsed, facts=dataclasses.replace(parsed.facts, store=False))

    def json_body(self, request: ParsedRequest[ResponsesFacts], response_id: str, completion: Completion) -> dict:
        built = super().json_body(request, response_id, completion)
        return compacted_response(response_id, built["output"][0], built["usage"])
