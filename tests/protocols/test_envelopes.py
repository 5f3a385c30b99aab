"""The envelope codec as pure functions (gateway/protocols/envelope.py), and the keyring kept
in the store (gateway/store/envelope_keys.py) on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.protocols.envelope import (
    PREFIX,
    EnvelopeInvalid,
    EnvelopeKey,
    Keyring,
    Tenant,
    open_sealed,
    seal,
)
from gateway.store import envelope_keys as keys_module
from gateway.store.db import Store, open_database
from gateway.store.envelope_keys import EnvelopeKeys

ALICE, BOB = "client:aaaaaaaaaaaaaaaa", "client:bbbbbbbbbbbbbbbb"
RING = Keyring([EnvelopeKey(1, b"\x01" * 32), EnvelopeKey(2, b"\x02" * 32, active_from=100.0)])


@given(st.text(), st.sampled_from(["r", "c", "gts:call_1"]))
def test_seal_then_open_is_the_identity(text: str, field: str) -> None:
    blob = seal(RING, field, ALICE, text.encode())
    assert open_sealed(RING, field, ALICE, blob) == text.encode()


def test_the_plaintext_is_not_in_the_envelope_and_each_seal_differs() -> None:
    a, b = seal(RING, "c", ALICE, b"the secret summary"), seal(RING, "c", ALICE, b"the secret summary")
    assert a != b and b"secret" not in a and len(a) == 1 + 4 + 12 + len(b"the secret summary") + 16


@pytest.mark.parametrize(
    "change,why",
    [
        (lambda blob: open_sealed(RING, "c", BOB, blob), "another client key"),
        (lambda blob: open_sealed(RING, "r", ALICE, blob), "another field"),
        (lambda blob: open_sealed(RING, "c", ALICE, blob[:-1]), "tag cut"),
        (lambda blob: open_sealed(RING, "c", ALICE, blob[:20]), "truncated"),
        (lambda blob: open_sealed(RING, "c", ALICE, blob[:30] + bytes([blob[30] ^ 1]) + blob[31:]), "altered"),
        (lambda blob: open_sealed(RING, "c", ALICE, b"\x02\x00\x00\x00\x09" + blob[5:]), "unknown key"),
        (lambda blob: open_sealed(RING, "c", ALICE, b"\x01" + blob[1:]), "old version"),
        (lambda blob: open_sealed(Keyring([EnvelopeKey(1, b"\x09" * 32)]), "c", ALICE, blob), "another store's key 1"),
    ],
)
def test_what_does_not_open(change: Callable[[bytes], bytes], why: str) -> None:
    blob = seal(RING, "c", ALICE, b"summary", now=50.0)
    with pytest.raises(EnvelopeInvalid):
        change(blob)


def test_the_newest_active_key_seals_and_every_key_opens() -> None:
    assert RING.sealing_key(50.0).number == 1  # key 2 is not active yet
    assert RING.sealing_key(100.0).number == 2
    old = seal(RING, "c", ALICE, b"old", now=50.0)
    new = seal(RING, "c", ALICE, b"new", now=150.0)
    assert old[1:5] == b"\x00\x00\x00\x01" and new[1:5] == b"\x00\x00\x00\x02"
    assert open_sealed(RING, "c", ALICE, old) == b"old" and open_sealed(RING, "c", ALICE, new) == b"new"
    with pytest.raises(EnvelopeInvalid):
        Keyring([]).sealing_key(0.0)


def test_tenant_open_tells_foreign_from_bad() -> None:
    alice, bob = Tenant(ALICE, lambda: RING), Tenant(BOB, lambda: RING)
    sealed = alice.seal("c", "summary")
    assert sealed.startswith(PREFIX) and alice.open("c", sealed) == "summary"
    assert alice.open("c", None) is None and alice.open("c", "gAAAA-another-provider") is None
    for value in (sealed[:-3], PREFIX + "%%%", "cb2a1.eyJjIjoieCJ9.abc"):
        with pytest.raises(GatewayError) as caught:
            alice.open("c", value, "input[0].encrypted_content")
        assert caught.value.code == "invalid_encrypted_content" and caught.value.status == 400
        assert caught.value.param == "input[0].encrypted_content"
    assert alice.open("r", "cb2a1.eyJyIjoieCJ9.abc", legacy=True) is None  # reasoning: the summary is used
    with pytest.raises(GatewayError):
        bob.open("c", sealed)


@pytest.mark.parametrize("signature", ["CiQBVKhc7sim+signature/for==call0", "not base64 at all!", base64.b64encode(bytes(300)).decode()])
def test_signature_tokens_are_id_safe_and_bound_to_client_and_call(signature: str) -> None:
    alice, bob = Tenant(ALICE, lambda: RING), Tenant(BOB, lambda: RING)
    token = alice.seal_signature("call_1", signature)
    assert all(c.isalnum() or c in "_-" for c in token)
    assert alice.open_signature("call_1", token) == signature
    assert bob.open_signature("call_1", token) is None and alice.open_signature("call_2", token) is None
    assert alice.open_signature("call_1", token[:-2]) is None and alice.open_signature("call_1", "x") is None
    if signature.startswith("AAAA"):  # canonical base64 is carried as bytes: the id grows by the envelope only
        assert len(token) <= len(signature) + 48


# -- the keyring in the store ------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    url = request.getfixturevalue("postgres_schema") if request.param == "postgres" else None
    opened: list[Store] = []

    def open_one() -> Store:
        db = open_database(url, tmp_path)
        opened.append(db)
        return db

    yield open_one
    for db in opened:
        db.close()


def test_replicas_share_one_keyring_and_adopt_rotations(opener: Callable[[], Store]) -> None:
    a, b = EnvelopeKeys(opener()), EnvelopeKeys(opener())
    a.load(), b.load()  # both start on an empty store: they agree on the one key 1
    assert [k.number for k in a().keys] == [k.number for k in b().keys] == [1]
    assert a().keys[0].secret == b().keys[0].secret and len(a().keys[0].secret) == 32
    old = Tenant(ALICE, a).seal("c", "sealed on a")
    assert Tenant(ALICE, b).open("c", old) == "sealed on a"

    async def rotate_and_refresh() -> None:
        key = await a.rotate()  # default: sealing only after two refresh intervals
        assert key.number == 2 and key.active_from >= time.time() + keys_module.ACTIVATION_DELAY - 5
        assert a().sealing_key(time.time()).number == 1
        await b.refresh()

    asyncio.run(rotate_and_refresh())
    assert [k.number for k in b().keys] == [1, 2]
    later = time.time() + keys_module.ACTIVATION_DELAY + 1
    new = Tenant(ALICE, a).seal("c", "after the rotation")
    assert new  # sealed now: still key 1
    blob = seal(a(), "c", ALICE, b"at activation", now=later)
    assert blob[1:5] == b"\x00\x00\x00\x02" and open_sealed(b(), "c", ALICE, blob) == b"at activation"
    assert Tenant(ALICE, b).open("c", old) == "sealed on a"  # old envelopes stay readable
    assert [row["key_number"] for row in a.status()] == [1, 2] and "secret" not in str(a.status())


def test_keys_superseded_past_the_retention_are_deleted_at_start_up(opener: Callable[[], Store], monkeypatch: pytest.MonkeyPatch) -> None:
    db = opener()
    keys = EnvelopeKeys(db)
    keys.load()
    asyncio.run(keys.rotate(activate_in=0))
    asyncio.run(keys.rotate(activate_in=0))
    assert [k.number for k in keys().keys] == [1, 2, 3]
    monkeypatch.setattr(keys_module, "RETIRED_KEY_SECONDS", 0.0)  # as if a month had passed
    time.sleep(0.01)
    assert [k.number for k in EnvelopeKeys(db).load().keys] == [3]
