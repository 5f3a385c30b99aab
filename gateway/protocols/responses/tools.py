"""Responses tools: declarations and ``tool_choice`` -> upstream, client-executed kinds included.

Function tools (namespaced ones under a flattened upstream name, :class:`ToolMap`
maps them back) become Chat function tools; hosted tools the upstream cannot run are
dropped. ``custom`` (freeform, e.g. Codex's ``apply_patch``), ``local_shell``, ``shell``
(with a local environment) and ``apply_patch`` are not hosted tools: the model only has
to say what to run. Upstream each becomes one Chat function tool with documented
parameters; the calls themselves (the model's call -> the tool's own output item, the
client's replayed calls and outputs -> chat) are client_tool_calls.py.

Pure functions and small tables, no I/O. docs/protocols/responses.md lists every shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError, invalid_request
from gateway.protocols.fields import MAX_NAME_CHARS, check_object_schema
from gateway.stream.accumulator import ToolRules

#: Joins a namespace and a tool name into one upstream function name (``ns__tool``).
NAMESPACE_SEP = "__"

#: Tool types that only OpenAI's own servers can run; dropped before the upstream.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer",
        "mcp",
        "tool_search",
    }
)

#: Tool types the client runs itself: function tools upstream (the kinds below).
CLIENT_TOOL_TYPES = frozenset({"custom", "local_shell", "shell", "apply_patch"})


@dataclass(slots=True)
class ToolMap:
    """Upstream function name -> what the client declared (name, namespace)."""

    client: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    flat: dict[tuple[str | None, str], str] = field(default_factory=dict)
    #: Upstream name -> client tool kind when not ``function`` (``custom``, ``local_shell``...).
    kinds: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, namespace: str | None, param: str, kind: str = "function") -> str:
        upstream = f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name
        if upstream in self.client:
            raise invalid_request(
                f"tool name {upstream!r} is declared twice (namespaced tools become "
                f"'<namespace>{NAMESPACE_SEP}<name>' upstream)",
                param=param,
                code="duplicate_tool_name",
            )
        self.client[upstream] = (name, namespace)
        self.flat[(namespace, name)] = upstream
        if kind != "function":
            self.kinds[upstream] = kind
        return upstream

    def upstream_name(self, name: str, namespace: str | None) -> str:
        known = self.flat.get((namespace, name))
        if known is not None:
            return known
        return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


#: Longest grammar definition copied into a freeform tool's description.
GRAMMAR_LIMIT = 6000

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


# -- declarations and tool_choice -> upstream -----------------------------------------


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


def _tool_name(tool: dict[str, Any], what: str, param: str) -> str:
    """A function or namespace tool's ``name`` (1 to MAX_NAME_CHARS characters), else a 400."""
    name = tool.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise invalid_request(
            f"a {what} tool needs a 'name' of 1 to {MAX_NAME_CHARS} characters",
            param=f"{param}.name",
            code="invalid_value",
        )
    return name


def _function_tool(
    tool: dict[str, Any], namespace: str | None, tool_map: ToolMap, param: str
) -> dict[str, Any]:
    name = _tool_name(tool, "function", param)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_object_schema(parameters, f"{param}.parameters")
    function: dict[str, Any] = {
        "name": tool_map.add(name, namespace, param),
        "parameters": parameters,
    }
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    if tool.get("strict") is True:
        function["strict"] = True
    return {"type": "function", "function": function}


def _client_tool(tool: dict[str, Any], kind: str, tool_map: ToolMap, param: str) -> dict[str, Any]:
    name, description, parameters = declaration(tool, kind, param)
    function = {
        "name": tool_map.add(name, None, param, kind),
        "description": description,
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


def upstream_tools(
    tools: list[dict[str, Any]], tool_map: ToolMap
) -> tuple[list[dict[str, Any]], list[str]]:
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        param = f"tools[{i}]"
        if not isinstance(kind, str):  # a list or an object here was a 500 (unhashable in the set tests)
            raise invalid_request(f"{param}.type must be a string", param=f"{param}.type", code="invalid_type")
        if kind == "function":
            out.append(_function_tool(tool, None, tool_map, param))
        elif kind == "namespace":
            namespace = _tool_name(tool, "namespace", param)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid_request(
                    "a namespace tool needs a 'tools' list", param=f"{param}.tools"
                )
            for j, nested in enumerate(inner):
                if not isinstance(nested, dict):
                    raise invalid_request("tools must be objects", param=f"{param}.tools[{j}]")
                if nested.get("type") == "function":
                    out.append(_function_tool(nested, namespace, tool_map, f"{param}.tools[{j}]"))
                else:
                    dropped.append(f"{namespace}.{nested.get('name') or nested.get('type')}")
        elif kind in CLIENT_TOOL_TYPES and not (kind == "shell" and not is_local_environment(tool)):
            out.append(_client_tool(tool, kind, tool_map, param))
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES | CLIENT_TOOL_TYPES:
            dropped.append(kind)
        else:
            raise invalid_request(
                f"unsupported tool type {kind!r}",
                param=f"{param}.type",
                code="unsupported_tool_type",
            )
    return out, dropped


def upstream_tool_choice(
    choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None, tool_map: ToolMap, dropped: list[str]
) -> tuple[ToolRules, Any]:
    """The rules the answer must obey and the upstream ``tool_choice`` (None: leave it out)."""
    declared = frozenset(tool_map.client)
    parallel = parallel_tool_calls is not False
    if choice is None:
        return ToolRules(declared=declared, choice="auto", parallel=parallel), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid_request(
                "tool_choice must be 'auto', 'none', 'required' or a function object",
                param="tool_choice",
            )
        if choice == "required" and not declared:
            raise invalid_request(
                "tool_choice 'required' needs at least one function tool"
                " (hosted tools are not available here)",
                param="tool_choice",
                code="unsupported_tool_choice",
            )
        return ToolRules(declared=declared, choice=choice, parallel=parallel), choice
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        namespace = choice.get("namespace")
        if not isinstance(name, str) or not name:
            raise invalid_request("tool_choice.name is required", param="tool_choice.name")
        namespace = namespace if isinstance(namespace, str) else None
        upstream = tool_map.upstream_name(name, namespace)
        if upstream not in declared:
            if (f"{namespace}.{name}" if namespace else name) in dropped:
                raise _dropped_choice(name)
            raise invalid_request(
                f"tool_choice names undeclared tool {name!r}", param="tool_choice.name"
            )
        rules = ToolRules(declared=declared, choice=upstream, parallel=parallel)
        return rules, {"type": "function", "function": {"name": upstream}}
    if kind in CLIENT_TOOL_TYPES - {"custom"} and kind in declared:
        rules = ToolRules(declared=declared, choice=kind, parallel=parallel)
        return rules, {"type": "function", "function": {"name": kind}}
    if isinstance(kind, str) and (kind in dropped or kind in HOSTED_TOOL_TYPES | CLIENT_TOOL_TYPES):
        raise _dropped_choice(kind)
    raise invalid_request(
        f"tool_choice of type {kind!r} is not supported by this gateway"
        " (only function tools run upstream)",
        param="tool_choice",
        code="unsupported_tool_choice",
    )


def _dropped_choice(name: str) -> GatewayError:
    return invalid_request(
        f"tool_choice names {name!r}, a tool this gateway does not offer the model"
        " (hosted tools run only on OpenAI's servers and are dropped; see docs/protocols/responses.md)",
        param="tool_choice",
        code="tool_choice_unavailable",
    )
