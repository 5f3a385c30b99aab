"""Client-executed Responses tool types: declared by the client, run by the client.

``custom`` (freeform, e.g. Codex's ``apply_patch``), ``local_shell``, ``shell`` (with a
local environment) and ``apply_patch`` are not hosted tools: the model only has to say
what to run. Upstream each becomes one Chat function tool with documented parameters;
the model's call comes back as the tool's own output item (``custom_tool_call`` with its
``input``, ``local_shell_call`` with its ``action``, ...), and the client's replayed calls
and outputs turn back into assistant ``tool_calls`` and ``tool`` messages.

Pure functions and small tables, no I/O. docs/protocols/responses.md lists every shape.
"""

from __future__ import annotations

from typing import Any

import jiter
import orjson

from gateway.errors import invalid_request

#: Longest grammar definition copied into a freeform tool's description.
GRAMMAR_LIMIT = 6000

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

_STRING_LIST = {"type": "array", "items": {"type": "string"}}

_LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {**_STRING_LIST, "description": "The command and its arguments (argv), e.g. [\"ls\", \"-la\"]."},
        "working_directory": {"type": "string", "description": "Directory to run the command in."},
        "timeout_ms": {"type": "integer", "description": "Timeout in milliseconds."},
        "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Extra environment variables."},
    },
    "required": ["command"],
    "additionalProperties": False,
}

_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "commands": {**_STRING_LIST, "description": "Shell commands to run in order, each one command line."},
        "timeout_ms": {"type": "integer", "description": "Timeout in milliseconds."},
        "max_output_length": {"type": "integer", "description": "Longest output to return, in characters."},
    },
    "required": ["commands"],
    "additionalProperties": False,
}

_APPLY_PATCH_PARAMETERS = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["create_file", "update_file", "delete_file"]},
        "path": {"type": "string", "description": "The file to create, update or delete."},
        "diff": {"type": "string", "description": "The V4A diff (create_file: the new file's lines, each prefixed with '+')."},
    },
    "required": ["type", "path"],
    "additionalProperties": False,
}

_DESCRIPTIONS = {
    "local_shell": "Run a command on the user's machine and get its output.",
    "shell": "Run shell commands on the user's machine and get their output.",
    "apply_patch": "Create, update or delete a file on the user's machine with a diff.",
}


def is_local_environment(tool: dict[str, Any]) -> bool:
    """A ``shell`` tool runs on the client only with no environment or a local one."""
    environment = tool.get("environment")
    return environment is None or (isinstance(environment, dict) and environment.get("type") == "local")


def _freeform_description(tool: dict[str, Any], param: str) -> str:
    """The tool's description plus what its ``input`` must look like (the grammar)."""
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    fmt = tool.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        note = "Pass the tool's whole input as the string argument `input` (freeform text, not JSON)."
    elif isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if not isinstance(definition, str) or not isinstance(syntax, str):
            raise invalid_request(
                "a grammar format needs a 'syntax' and a 'definition' string",
                param=f"{param}.format",
                code="invalid_value",
            )
        if len(definition) > GRAMMAR_LIMIT:
            definition = definition[:GRAMMAR_LIMIT] + "\n... (grammar truncated)"
        note = (
            "Pass the tool's whole input as the string argument `input` (freeform text, not JSON). "
            f"The input must match this {syntax} grammar:\n{definition}"
        )
    else:
        raise invalid_request(
            "a custom tool's format must be {'type': 'text'} or {'type': 'grammar', ...}",
            param=f"{param}.format",
            code="invalid_value",
        )
    return f"{description}\n\n{note}" if description else note


def declaration(tool: dict[str, Any], kind: str, param: str) -> tuple[str, str, dict[str, Any]]:
    """(client name, description, JSON parameters) of the function tool sent upstream."""
    if kind == "custom":
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(
                "a custom tool needs a non-empty 'name'", param=f"{param}.name", code="invalid_value"
            )
        parameters = {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's freeform input."}},
            "required": ["input"],
            "additionalProperties": False,
        }
        return name, _freeform_description(tool, param), parameters
    parameters = {
        "local_shell": _LOCAL_SHELL_PARAMETERS,
        "shell": _SHELL_PARAMETERS,
        "apply_patch": _APPLY_PATCH_PARAMETERS,
    }[kind]
    return kind, _DESCRIPTIONS[kind], parameters


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
