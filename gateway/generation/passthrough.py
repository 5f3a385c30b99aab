"""Routes relayed to the pool as the upstream answers them: ``POST /v1/completions``
(legacy text completions, streamed or not) and ``POST /v1/embeddings``.

They take the way every generation request takes (:class:`~gateway.generation.service.GenerationService`:
client key, body limit, value limits, capacity slot, failover between credentials, one
audit record with usage, metrics, the shutdown abort) but none of the chat answer
machinery: there are no blocks to validate or repair, so the upstream's answer is relayed
as it is, with the gateway's id and the client's model name on it. Each route names
:class:`RelayedCall` as its ``run_type``, the generation service builds it in place of a
:class:`~gateway.generation.run.GenerationRun`.

What the stream modes mean for ``/v1/completions`` (docs/protocols/completions.md):
realtime relays each upstream chunk as it arrives; compatible collects the whole stream,
checks that it finished (a ``finish_reason``, no error), then sends it. Both send an SSE
comment keepalive after each quiet interval (the first one commits the status line, as
for chat). Embeddings are one JSON answer in both modes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from gateway.errors import GatewayError, invalid_request
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.protocols.base import ParsedRequest, dumps, load_json_object, sse, validation_error
from gateway.protocols.envelope import ANONYMOUS_TENANT, Tenant
from gateway.protocols.fields import (
    Int64,
    Name,
    OutputTokens,
    Penalty,
    Probability,
    StopSequences,
    Temperature,
    TokenBias,
    TokenId,
)
from gateway.protocols.openai_shapes import error_json
from gateway.redact import SECRETS
from gateway.settings import StreamMode
from gateway.upstream.attempts import UpstreamAttempts
from gateway.upstream.client import ANSWERED, Done, Send

#: At most this many prompts or inputs in one body (OpenAI's own limit for embeddings).
MAX_ITEMS = 2048
#: At most this many token ids in one body's ``prompt`` / ``input`` (two 128 k contexts):
#: past it, 413 ``too_many_token_ids`` before the ids are validated one by one. A 27 MiB
#: body of ids cost 62 s of parsing, and the relay then serialises the body again.
MAX_TOKEN_IDS = 262_144

PromptValue = StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]

KEEPALIVE = b": keepalive\n\n"
DONE_FRAME = b"data: [DONE]\n\n"


def _bounded(value: Any, param: str) -> Any:
    """Not empty, and not more than :data:`MAX_ITEMS` prompts or inputs."""
    if value == "" and param == "input":
        raise ValueError("input must not be empty")
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{param} must not be empty")
        if len(value) > MAX_ITEMS:
            raise ValueError(f"{param} holds {len(value)} items; at most {MAX_ITEMS} per request")
    return value


class _CompletionsBody(BaseModel):
    """What the gateway checks of a text completion; any other key passes through."""

    model_config = ConfigDict(extra="allow")
    model: Name
    prompt: PromptValue
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: StrictInt | None = Field(None, ge=1, le=128)
    best_of: StrictInt | None = Field(None, ge=1, le=128)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    stop: StopSequences | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, TokenBias] | None = None
    user: StrictStr | None = None

    _prompt_size = field_validator("prompt")(lambda v: _bounded(v, "prompt"))


class _EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Name
    input: PromptValue
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(None, ge=1, le=65536)
    user: StrictStr | None = None

    _input_size = field_validator("input")(lambda v: _bounded(v, "input"))


def token_ids(value: Any) -> int:
    """The token ids a ``prompt`` / ``input`` holds (a list of lists: their lengths; C-speed
    ``len`` only, no walk of the ids)."""
    if not isinstance(value, list) or not value:
        return 0
    if all(isinstance(item, list) for item in value):
        return sum(len(item) for item in value)
    return len(value) if not isinstance(value[0], str) else 0


def _validated(model: type[BaseModel], body: bytes, field: str) -> tuple[BaseModel, dict[str, Any]]:
    def within_token_ids(raw: dict[str, Any]) -> None:
        ids = token_ids(raw.get(field))
        if ids > MAX_TOKEN_IDS:
            raise GatewayError("invalid_request", "too_many_token_ids",
                               f"{field} holds {ids} token ids; at most {MAX_TOKEN_IDS} per request",
                               param=field, status=413)

    raw = load_json_object(body, precheck=within_token_ids)
    try:
        return model.model_validate(raw), raw
    except ValidationError as exc:
        raise validation_error(exc) from None


class _RelayedRoute:
    """What both relayed routes share: the OpenAI error shape and no answer machinery."""

    name: str
    path: str  # upstream path under the credential's base URL
    id_prefix: str
    sequential_blocks = False

    @property
    def run_type(self) -> type[RelayedCall]:
        return RelayedCall

    def new_response_id(self) -> str:
        return self.id_prefix + secrets.token_hex(12)

    async def resolve(self, request: ParsedRequest) -> ParsedRequest:
        return request

    async def completed(self, request: ParsedRequest, response_id: str, completion: Any, encoder: object) -> None:
        return None

    def json_body(self, request: ParsedRequest, response_id: str, answer: Any) -> dict:
        """The relayed answer (``RelayedCall.collect`` already put the id and model on it)."""
        return answer

    def error_body(self, error: GatewayError) -> dict:
        return error_json(error)


class CompletionsRoute(_RelayedRoute):
    """``POST /v1/completions``: ``prompt`` as text, texts or token ids; ``logprobs``,
    ``echo``, ``suffix`` and every other key passed to the upstream's ``/completions``."""

    name = "completions"
    path = "/completions"
    id_prefix = "cmpl-"

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[bool]:
        parsed, raw = _validated(_CompletionsBody, body, "prompt")
        assert isinstance(parsed, _CompletionsBody)
        include_usage = bool((parsed.stream_options or {}).get("include_usage"))
        upstream = {k: v for k, v in raw.items() if k not in ("stream", "stream_options")}
        return ParsedRequest(self.name, parsed.model, parsed.stream, upstream, facts=include_usage, tenant=tenant)


class EmbeddingsRoute(_RelayedRoute):
    """``POST /v1/embeddings``: relayed to the upstream's ``/embeddings`` as sent."""

    name = "embeddings"
    path = "/embeddings"
    id_prefix = "emb-"

    def parse(self, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT) -> ParsedRequest[bool]:
        parsed, raw = _validated(_EmbeddingsBody, body, "input")
        if raw.get("stream") is not None:
            raise invalid_request("embeddings are not streamed", param="stream", code="stream_not_supported")
        return ParsedRequest(self.name, parsed.model, False, dict(raw), facts=False, tenant=tenant)


class _Ended:
    def __init__(self, error: GatewayError | None) -> None:
        self.error = error


class RelayedCall:
    """One relayed request: the upstream's answer read with failover and relayed. The
    generation service's counterpart of a GenerationRun (same constructor, ``stream``,
    ``collect``, ``abort``, ``record``, ``error``, ``committed``); it writes what it
    learns (attempts, usage, finish reason) into the record itself."""

    def __init__(
        self, room: _RelayedRoute, parsed: ParsedRequest, policy: StreamPolicy, record: RequestRecord,
        attempts: UpstreamAttempts,
    ) -> None:
        self.room = room
        self.parsed = parsed
        self.policy = policy
        self.record = record
        self.attempts = attempts
        self.response_id = room.new_response_id()
        self.error: GatewayError | None = None
        self.committed = False
        self.terminated = False  # the last frame was released: nothing follows
        self.rollout_id: str | None = None
        self.rollout_group: str | None = None
        self.completion = None  # no chat answer (the service's JSON path passes collect()'s dict)
        self._aborted: GatewayError | None = None
        self._task: asyncio.Task[Any] | None = None
        self._finished = False  # a finish_reason was seen
        self._include_usage = parsed.facts is True

    # -- what the service calls ------------------------------------------------------------

    def released(self) -> None:
        """A relayed answer is never a recorded rollout call: nothing to confirm."""

    def abort(self, error: GatewayError) -> None:
        """End it early with ``error`` (graceful shutdown): the upstream read is cancelled."""
        if self._aborted is None:
            self._aborted = error
            if self._task is not None:
                self._task.cancel()

    async def collect(self) -> dict[str, Any]:
        """The upstream's one JSON answer, as the client gets it; raises GatewayError."""
        send = self.attempts.client.json_path(self.room.path)
        self._task = asyncio.ensure_future(self._one_answer(send))
        try:
            answer = await self._task
        except asyncio.CancelledError:
            if self._aborted is None:
                raise
            raise self._aborted from None
        finally:
            self._note_attempts()
        self._note(answer)
        return self._relabel(answer)

    async def stream(self) -> AsyncIterator[bytes | GatewayError]:
        """A GatewayError first (nothing sent: the service answers a real status), else the
        frames; a failure after that is an in-stream ``{"error": ...}`` frame."""
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)
        self._task = asyncio.ensure_future(self._pump(queue))
        held: list[bytes] = []  # compatible: the whole answer before any of it
        realtime = self.policy.mode is StreamMode.REALTIME
        try:
            while True:
                try:  # asyncio.timeout: wait_for (3.11) could swallow the client-gone cancel
                    async with asyncio.timeout(self.policy.keepalive_interval):
                        item = await queue.get()
                except TimeoutError:
                    yield self._commit(KEEPALIVE)
                    self.record.keepalives += 1
                    continue
                if isinstance(item, _Ended):
                    error = item.error or (None if self._finished else _incomplete())
                    if error is not None:
                        self.error = error
                        if not self.committed:
                            yield error
                        else:
                            self.terminated = True
                            yield sse(dumps(error_json(error))) + DONE_FRAME
                        return
                    self.terminated = True
                    yield self._commit(b"".join(held) + DONE_FRAME)
                    return
                frame = self._frame(item)
                if not frame:
                    continue
                if realtime:
                    yield self._commit(frame)
                else:
                    held.append(frame)
        finally:
            if not self._task.done():
                self._task.cancel()
            self._note_attempts()

    # -- the upstream side --------------------------------------------------------------------

    async def _one_answer(self, send: Send) -> dict[str, Any]:
        async for item in self.attempts.stream(self.parsed.upstream_body, send):
            if isinstance(item, dict):
                return item
        raise _incomplete()

    async def _pump(self, queue: asyncio.Queue[Any]) -> None:
        """The upstream's chunks into the queue, then one _Ended."""
        send = self.attempts.client.stream_path(self.room.path)
        ended = _Ended(None)
        try:
            async for item in self.attempts.stream(self.parsed.upstream_body, send):
                if item is ANSWERED or isinstance(item, Done):
                    continue
                if item.get("error"):
                    message = SECRETS.mask(str((item["error"] or {}).get("message") if isinstance(item["error"], dict) else item["error"]))
                    raise GatewayError("upstream", "upstream_error", f"the upstream reported an error: {message}")
                await queue.put(item)
        except GatewayError as err:
            ended = _Ended(err)
        except asyncio.CancelledError:
            if self._aborted is None:
                raise
            ended = _Ended(self._aborted)
            while not queue.empty():
                queue.get_nowait()
        queue.put_nowait(ended)

    # -- frames and the record --------------------------------------------------------------

    def _frame(self, chunk: dict[str, Any]) -> bytes:
        self._note(chunk)
        if not chunk.get("choices") and chunk.get("usage") is not None and not self._include_usage:
            return b""  # the usage chunk the gateway asked for itself
        if self.record.ttft_ms is None and any(c.get("text") for c in chunk.get("choices") or () if isinstance(c, dict)):
            self.record.ttft_ms = round((time.time() - self.record.started_at) * 1000, 2)
        return sse(dumps(self._relabel(chunk)))

    def _relabel(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The gateway's id and the client's model name on the upstream's answer; an
        engine's MoE routing (``routed_experts``) is for training records, never a client."""
        out = {k: v for k, v in answer.items() if k != "routed_experts"}
        out["model"] = self.parsed.model
        if isinstance(out.get("choices"), list):
            out["choices"] = [{k: v for k, v in c.items() if k != "routed_experts"} if isinstance(c, dict) else c
                              for c in out["choices"]]
        if "id" in answer or self.room.name == "completions":
            out["id"] = self.response_id
        return out

    def _commit(self, frame: bytes) -> bytes:
        self.committed = True
        self.record.output_bytes += len(frame)
        return frame

    def _note(self, answer: dict[str, Any]) -> None:
        usage = answer.get("usage")
        if isinstance(usage, dict):
            self.record.usage = {
                k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens")
                if isinstance(usage.get(k), int) and not isinstance(usage.get(k), bool)
            }
        for choice in answer.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
                self._finished = True
                self.record.finish_reason = choice["finish_reason"]
        if self.room.name == "embeddings":
            self._finished = True

    def _note_attempts(self) -> None:
        self.record.upstream_attempts = self.attempts.log
        if self.attempts.upstream_model is not None:
            self.record.upstream_model = self.attempts.upstream_model


def _incomplete() -> GatewayError:
    return GatewayError("upstream", "upstream_incomplete", "the upstream ended without a finish_reason")
