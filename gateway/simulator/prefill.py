"""vLLM's assistant prefill in the simulator: ``continue_final_message: true`` (with
``add_generation_prompt: false``, as vLLM requires) continues the final assistant message
instead of starting a new one. The scripted answer is the whole answer, so a continuation
is that answer with the prefill taken off its start, with its token ids (when it starts
with it: otherwise the engine "says something else", and the script is sent as it is)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from gateway.simulator import token_in as sim_token_in
from gateway.simulator.reply import Frame, chat_messages
from gateway.simulator.scenarios import assemble_completion


def prefill_of(body: Mapping[str, Any]) -> str | None:
    """The assistant text to continue, when the body asks for a continuation."""
    if body.get("continue_final_message") is not True:
        return None
    messages = chat_messages(body)
    last = messages[-1] if messages else {}
    content = last.get("content")
    return content if last.get("role") == "assistant" and isinstance(content, str) else None


def refusal(body: Mapping[str, Any]) -> str | None:
    """vLLM's 400 for a continuation that also asks for a generation prompt (its default)."""
    if body.get("continue_final_message") is True and body.get("add_generation_prompt", True) is not False:
        return "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    return None


def continued(frames: list[Frame], prefill: str) -> list[Frame]:
    """``frames`` with ``prefill`` taken off the start of their content (a prefill in
    Hermes markup: :func:`markup_continued`)."""
    if prefill.startswith("<think>") or "<tool_call>" in prefill:
        return markup_continued(frames, prefill)
    text = "".join(_content(f) for f in frames)
    if not prefill or not text.startswith(prefill):
        return frames
    out, left = [], len(prefill)
    for n, frame in enumerate(copy.deepcopy(frames)):
        content = _content(frame)
        if left and content:
            cut = min(left, len(content))
            _cut(frame["choices"][0], content, cut)
            left -= cut
            if n and _emptied(frame):  # the engine samples only what follows the prefill
                continue
        out.append(frame)
        if isinstance(frame.get("usage"), dict):  # the completion is what is left (sim_scenarios' count)
            usage = frame["usage"]
            usage["completion_tokens"] = (len(text) - len(prefill)) // 4 + 1
            usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
    return out


#: Characters per chunk of a markup continuation.
MARKUP_CHUNK = 4


def markup_continued(frames: list[Frame], prefill: str) -> list[Frame]:
    """A prefill in the Hermes / Qwen markup the model writes (a cut reasoning: ``<think>``
    and the reasoning so far; a cut tool call: ``<tool_call>\n{"name": ..., "arguments": ``
    and the arguments so far): the model goes on in raw text from where it ends, and the
    engine's parsers, which never saw the opening tag in the output, pass it all as
    ``content`` (the gateway reads it). Finish ``stop``: no call was parsed."""
    message = assemble_completion(frames, "sim")["choices"][0]["message"]
    whole = "".join(text for _, text in sim_token_in.chat_sampled(message))
    if not whole.startswith(prefill):
        return frames
    rest = whole[len(prefill) :]
    out: list[Frame] = [{"choices": [{"index": 0, "delta": {"content": rest[at : at + MARKUP_CHUNK]},
                                      "finish_reason": None}]} for at in range(0, len(rest), MARKUP_CHUNK)]
    out = out or [{"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}]
    out[0]["choices"][0]["delta"] = {"role": "assistant", **out[0]["choices"][0]["delta"]}
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    for frame in frames:  # the usage and [DONE] as the script sends them
        if frame.get("_op") == "done" or frame.get("choices") == [] and isinstance(frame.get("usage"), dict):
            out.append(frame)
    return out


def _cut(choice: dict[str, Any], content: str, cut: int) -> None:
    """The first ``cut`` characters off a chunk's content, and off its token ids and
    logprobs when it has one token per character (sim_tokens' tokenizer)."""
    choice["delta"]["content"] = content[cut:]
    ids = choice.get("token_ids")
    if isinstance(ids, list) and len(ids) == len(content):
        choice["token_ids"] = ids[cut:]
    entries = (choice.get("logprobs") or {}).get("content")
    if isinstance(entries, list) and len(entries) == len(content):
        choice["logprobs"] = {**choice["logprobs"], "content": entries[cut:]}


def _emptied(frame: Frame) -> bool:
    """A chunk the cut left with nothing to say (no text, ids, finish or usage)."""
    choice = frame["choices"][0]
    return (set(frame) <= {"choices"} and not choice.get("finish_reason") and not choice.get("token_ids")
            and not choice["delta"].get("content") and set(choice["delta"]) <= {"content", "role"})


def _content(frame: Frame) -> str:
    choices = frame.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""
