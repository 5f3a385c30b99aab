"""Client-executed tool calls (``custom``, ``local_shell``, ``shell``, ``apply_patch``) as items.

tools.py declares these kinds upstream as Chat function tools; this is the other side,
the calls themselves: the model's function call -> the client's own output item
(``custom_tool_call`` with its ``input``, ``local_shell_call`` with its ``action``, ...,
and :class:`CustomInputStream` for a ``custom`` input as it streams), and the client's
replayed calls and outputs -> the arguments and ``tool`` message text the upstream reads.
Split from tools.py so the declaration side and the item side each stay one concern.

Pure functions and small tables, no I/O. docs/protocols/responses.md lists every shape.
"""

from __future__ import annotations

from typing import Any

import jiter
import orjson

from gateway.errors import invalid_request

#: Output item type of each client-executed tool kind (``function`` is the plain case).
CALL_ITEM = {
    "custom": "custom_tool_call",
    "local_shell": "local_shell_call",
    "shell": "shell_call",
    "apply_patch": "apply_patch_call",
}

#: Input item type -> tool kind, for replayed calls.
REPLAYED_CALLS = {item: kind for kind, item in CALL_ITEM.items()}

#: Output items the client sends back after running a client-executed tool.
CALL_OUTPUTS = frozenset(
    {"custom_tool_call_output", "local_shell_call_output", "shell_call_output", "apply_patch_call_output"}
)


# -- the model's call -> the client's output item --------------------------------------


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value] if isinstance(value, list) else []


def custom_input(arguments: str) -> str:
    """The freeform input of a ``custom`` call (raw arguments when not the JSON object)."""
    value = _arguments(arguments).get("input")
    return value if isinstance(value, str) else arguments


def call_item(
    kind: str, item_id: str, call_id: str, name: str, namespace: str | None, arguments: str, status: str
) -> dict[str, Any]:
    """The output item of a client-executed tool call (``kind`` is not ``function``)."""
    item: dict[str, Any] = {"id": item_id, "type": CALL_ITEM[kind], "status": status, "call_id": call_id}
    args = _arguments(arguments)
    if kind == "custom":
        item.update(name=name, input=custom_input(arguments))
        if namespace is not None:
            item["namespace"] = namespace
    elif kind == "local_shell":
        action: dict[str, Any] = {"type": "exec", "command": _strings(args.get("command")), "env": {}}
        if isinstance(args.get("env"), dict):
            action["env"] = {str(k): str(v) for k, v in args["env"].items()}
        for key in ("timeout_ms", "working_directory"):
            if args.get(key) is not None:
                action[key] = args[key]
        item["action"] = action
    elif kind == "shell":
        shell: dict[str, Any] = {"commands": _strings(args.get("commands"))}
        for key in ("timeout_ms", "max_output_length"):
            shell[key] = args.get(key) if isinstance(args.get(key), int) else None
        item["action"] = shell
    else:  # apply_patch
        operation: dict[str, Any] = {"type": args.get("type") or "update_file", "path": str(args.get("path") or "")}
        if operation["type"] != "delete_file":
            operation["diff"] = str(args.get("diff") or "")
        item["operation"] = operation
        item["status"] = "completed" if status == "completed" else "in_progress"
    return item


# -- replayed calls and outputs -> chat --------------------------------------------------


def replayed_arguments(item: dict[str, Any], kind: str, param: str) -> tuple[str, str]:
    """(client name, JSON arguments) of a replayed client-executed call item."""
    if kind == "custom":
        name, value = item.get("name"), item.get("input")
        if not isinstance(name, str) or not name:
            raise invalid_request("custom_tool_call needs a name", param=f"{param}.name")
        if not isinstance(value, str):
            raise invalid_request(
                "custom_tool_call input must be a string", param=f"{param}.input", code="invalid_type"
            )
        return name, orjson.dumps({"input": value}).decode()
    if kind == "apply_patch":
        operation = item.get("operation")
        if not isinstance(operation, dict):
            raise invalid_request("apply_patch_call needs an operation", param=f"{param}.operation")
        args = {k: operation[k] for k in ("type", "path", "diff") if k in operation}
        return kind, orjson.dumps(args).decode()
    action = item.get("action")
    if not isinstance(action, dict):
        raise invalid_request(f"{item.get('type')} needs an action", param=f"{param}.action")
    keys = ("command", "working_directory", "timeout_ms", "env") if kind == "local_shell" else (
        "commands", "timeout_ms", "max_output_length"
    )
    args = {k: action[k] for k in keys if action.get(k) is not None}
    return kind, orjson.dumps(args).decode()


def replayed_call_id(item: dict[str, Any], param: str) -> str:
    """``call_id`` (``local_shell_call`` items may carry only their ``id``)."""
    call_id = item.get("call_id") or (item.get("id") if item.get("type") == "local_shell_call" else None)
    if not isinstance(call_id, str) or not call_id:
        raise invalid_request(f"{item.get('type')} needs a call_id", param=f"{param}.call_id")
    return call_id


def output_text(item: dict[str, Any]) -> str | list[Any] | None:
    """A client tool output's content for the upstream ``tool`` message (None: invalid)."""
    kind = item.get("type")
    output = item.get("output")
    if kind == "shell_call_output" and isinstance(output, list):
        chunks = []
        for entry in output:
            if not isinstance(entry, dict):
                continue
            outcome = entry.get("outcome") if isinstance(entry.get("outcome"), dict) else {}
            text = str(entry.get("stdout") or "")
            if entry.get("stderr"):
                text += ("\n" if text else "") + "stderr: " + str(entry["stderr"])
            if outcome.get("type") == "exit":
                text += f"\n(exit code {outcome.get('exit_code')})"
            elif outcome.get("type") == "timeout":
                text += "\n(timed out)"
            chunks.append(text)
        return "\n".join(chunks)
    if kind == "apply_patch_call_output":
        status = item.get("status") or "completed"
        return f"{status}: {output}" if isinstance(output, str) and output else str(status)
    if isinstance(output, (str, list)):
        return output
    return None


def output_call_id(item: dict[str, Any]) -> str | None:
    call_id = item.get("call_id") or (item.get("id") if item.get("type") == "local_shell_call_output" else None)
    return call_id if isinstance(call_id, str) and call_id else None


class CustomInputStream:
    """The freeform input of a ``custom`` call as its JSON arguments arrive.

    The upstream streams ``{"input": "..."}``; the client wants the decoded text. jiter's
    partial parser reads the string so far (monotonic: a prefix of the final value);
    re-parsing is throttled to every :data:`PARSE_STEP` new bytes, so a long patch costs
    a bounded number of parses. :meth:`finish` returns what is left to release."""

    PARSE_STEP = 256

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._parsed_at = 0
        self.sent = ""

    def feed(self, fragment: str) -> str:
        self._parts.append(fragment)
        self._size += len(fragment)
        if self._size - self._parsed_at < self.PARSE_STEP and self.sent:
            return ""
        self._parsed_at = self._size
        return self._release(self._partial("".join(self._parts)))

    def finish(self, arguments: str) -> str:
        """The rest of the final input (all of it agrees with what was released)."""
        return self._release(custom_input(arguments))

    def _release(self, value: str | None) -> str:
        if value is None or not value.startswith(self.sent) or len(value) == len(self.sent):
            return ""
        new = value[len(self.sent) :]
        self.sent = value
        return new

    @staticmethod
    def _partial(arguments: str) -> str | None:
        try:
            value = jiter.from_json(arguments.encode(), partial_mode="trailing-strings")
        except ValueError:
            return None
        text = value.get("input") if isinstance(value, dict) else None
        return text if isinstance(text, str) else None
