"""A Responses tool whose ``type`` is not a string is a named 400, never a 500 (issue #36:
a random mutation pass over the generation routes found two 5xx on /v1/responses: a list
or an object as a tool's ``type`` raised ``TypeError: unhashable`` in the tool-kind sets).
The translation is fed directly; the route's shape for it is the one every 400 has."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.protocols.responses.translate import translate


@pytest.mark.parametrize("kind", [[{}], {"a": 1}, [1], None, 3, {}])
def test_a_tool_type_that_is_no_string_is_invalid_type(kind: Any) -> None:
    body = {"model": "text", "input": "hi", "tools": [{"type": "local_shell"}, {"type": kind, "name": "f"}]}
    with pytest.raises(GatewayError) as refused:
        translate(body)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_type", "tools[1].type")
