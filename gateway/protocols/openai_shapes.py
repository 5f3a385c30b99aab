"""OpenAI shapes shared by the Chat Completions and Responses rooms: the error body and
its ``type`` per error kind, Chat usage, and an answer as a Chat assistant message (JSON
answers, and the history a stored Responses answer adds to the next turn)."""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError
from gateway.stream.events import Completion, Usage

#: ``error.type`` per GatewayError kind (OpenAI's names).
ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "upstream": "api_error",
    "timeout": "api_error",
    "overloaded": "server_error",
    "internal": "server_error",
}


def error_json(error: GatewayError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: HTTP bodies and Chat's in-stream error."""
    return {
        "error": {
            "message": error.message,
            "type": ERROR_TYPES.get(error.kind, "api_error"),
            "param": error.param,
            "code": error.code,
        }
    }


def usage_json(usage: Usage) -> dict[str, Any]:
    """Chat Completions ``usage``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens_details": {**usage.completion_details, "reasoning_tokens": usage.reasoning_tokens},
        "prompt_tokens_details": {**usage.prompt_details, "cached_tokens": usage.cached_tokens},
    }


def assistant_message(completion: Completion) -> dict[str, Any]:
    """An answer as a Chat Completions assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.text or None}
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.refusal:
        message["refusal"] = completion.refusal
    if completion.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in completion.tool_calls
        ]
    return message
