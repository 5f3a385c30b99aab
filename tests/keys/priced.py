"""A gateway in front of the session simulator whose ``--config`` prices the model ``text``:
the spend, money-budget and budget-left tests each start one (module-scoped)."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway


def priced_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory,
                   price: str = "{ input = 3.0, output = 15.0 }") -> Gateway:
    """``price``: the model table's ``price`` (TOML inline table, per million tokens)."""
    config = tmp_path_factory.mktemp("priced") / "prices.toml"
    config.write_text(f"""
[[upstreams]]
name = "sim"
base_url = "{simulator.url}/v1"

[models."text"]
price = {price}
""")
    return start_gateway(server_loop, simulator, tmp_path_factory, config=config)
