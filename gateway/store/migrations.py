"""The schema's migrations, written once in SQLite's dialect as ``(version, sql)`` (never
edit an old one; append), and :func:`ddl`, the one place that maps types for PostgreSQL
(``REAL`` -> ``DOUBLE PRECISION``, ``INTEGER`` -> ``BIGINT``). A migration that only one
backend needs is a ``{"sqlite": ..., "postgres": ...}`` dict. Both backends apply them
(gateway/store/db.py for SQLite, gateway/store/postgres.py for PostgreSQL)."""

from __future__ import annotations

import re

Migration = tuple[int, "str | dict[str, str]"]

MIGRATIONS: list[Migration] = [
    (
        1,
        """
        CREATE TABLE audit (
            request_id TEXT PRIMARY KEY,
            started_at REAL NOT NULL,
            ended_at REAL NOT NULL,
            protocol TEXT NOT NULL,
            mode TEXT NOT NULL,
            streamed INTEGER NOT NULL,
            model TEXT NOT NULL,
            outcome TEXT NOT NULL,
            error_code TEXT,
            http_status INTEGER NOT NULL,
            record TEXT NOT NULL
        );
        CREATE INDEX audit_started ON audit (started_at);
        """,
    ),
    (
        2,
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            created_at REAL NOT NULL,
            body TEXT NOT NULL
        );
        """,
    ),
    (
        3,
        """
        CREATE TABLE credential_state (
            credential_id TEXT PRIMARY KEY,
            state TEXT NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE credentials (
            credential_id TEXT PRIMARY KEY,
            upstream TEXT NOT NULL,
            base_url TEXT NOT NULL,
            api_key TEXT,
            created_at REAL NOT NULL
        );
        """,
    ),
    (
        4,
        """
        CREATE TABLE saved_settings (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );
        CREATE TABLE settings_revision (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            revision INTEGER NOT NULL
        );
        INSERT INTO settings_revision (id, revision) VALUES (1, 0);
        CREATE TABLE settings_history (
            revision INTEGER PRIMARY KEY,
            at REAL NOT NULL,
            actor TEXT NOT NULL,
            changes TEXT NOT NULL
        );
        """,
    ),
    (
        5,
        # credential_state.version: replicas apply a polled row only when it is newer than
        # what they last wrote or read. replicas: the heartbeat table behind capacity shares.
        """
        ALTER TABLE credential_state ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
        CREATE TABLE replicas (
            replica_id TEXT PRIMARY KEY,
            started_at REAL NOT NULL,
            heartbeat_at REAL NOT NULL,
            in_flight INTEGER NOT NULL,
            info TEXT NOT NULL
        );
        """,
    ),
    (
        6,
        {
            "sqlite": "",
            # SQLite's JSON functions as used by callers' queries (paths '$.a.b' only), so the
            # same SQL runs on both; see gateway.store.postgres.to_postgres for WHEN json_extract.
            "postgres": """
            CREATE OR REPLACE FUNCTION json_extract(doc text, path text) RETURNS jsonb
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT NULLIF(doc::jsonb #> string_to_array(substr(path, 3), '.'), 'null'::jsonb)
            $fn$;
            CREATE OR REPLACE FUNCTION json_array_length(doc text, path text) RETURNS bigint
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT CASE WHEN v IS NULL THEN NULL WHEN jsonb_typeof(v) = 'array'
                            THEN jsonb_array_length(v) ELSE 0 END
                FROM (SELECT doc::jsonb #> string_to_array(substr(path, 3), '.') AS v) AS s
            $fn$;
            CREATE OR REPLACE FUNCTION json_truthy(doc text, path text) RETURNS boolean
            LANGUAGE sql IMMUTABLE AS $fn$
                SELECT CASE jsonb_typeof(v) WHEN 'boolean' THEN v::text::boolean
                            WHEN 'number' THEN v::text::numeric <> 0 ELSE false END
                FROM (SELECT doc::jsonb #> string_to_array(substr(path, 3), '.') AS v) AS s
            $fn$;
            """,
        },
    ),
    (
        7,
        # audit.transport (http | websocket), filterable: generated from the record, so the
        # row the writer upserts (and the spill journal holds) keeps its shape and old rows
        # are backfilled by the migration itself; a record from before the field = NULL.
        # PostgreSQL: a stored column (its ALTER rewrites the table once); jsonb refuses a
        # \u0000 escape, so such a record is read by pattern instead of failing its insert.
        {
            "sqlite": """
            ALTER TABLE audit ADD COLUMN transport TEXT GENERATED ALWAYS AS
                (CASE WHEN json_valid(record) THEN json_extract(record, '$.transport') END) VIRTUAL;
            CREATE INDEX audit_transport ON audit (transport, started_at);
            """,
            "postgres": """
            CREATE OR REPLACE FUNCTION audit_transport(doc text) RETURNS text
            LANGUAGE plpgsql IMMUTABLE AS $fn$
            BEGIN
                RETURN doc::jsonb ->> 'transport';
            EXCEPTION WHEN others THEN
                RETURN substring(doc from '"transport"[[:space:]]*:[[:space:]]*"(http|websocket)"');
            END
            $fn$;
            ALTER TABLE audit ADD COLUMN transport TEXT GENERATED ALWAYS AS (audit_transport(record)) STORED;
            CREATE INDEX audit_transport ON audit (transport, started_at);
            """,
        },
    ),
    (
        8,
        # responses.owner: the client identity (gateway/keys/identity.py) that created the row;
        # NULL for rows from before (readable only while no client key is configured).
        # envelope_keys: the keyring of gateway/protocols/envelope.py, shared by replicas.
        """
        ALTER TABLE responses ADD COLUMN owner TEXT;
        CREATE TABLE envelope_keys (
            key_number INTEGER PRIMARY KEY,
            secret TEXT NOT NULL,
            created_at REAL NOT NULL,
            active_from REAL NOT NULL
        );
        """,
    ),
    (
        9,
        # rollouts (gateway/rollout/store.py): one row per model call of a rollout (the
        # call record as JSON), and marks on a rollout (frozen, incomplete: why).
        """
        CREATE TABLE rollout_calls (
            call_id TEXT PRIMARY KEY,
            rollout_id TEXT NOT NULL,
            started_at REAL NOT NULL,
            ended_at REAL NOT NULL,
            record TEXT NOT NULL
        );
        CREATE INDEX rollout_calls_rollout ON rollout_calls (rollout_id, started_at);
        CREATE INDEX rollout_calls_ended ON rollout_calls (ended_at);
        CREATE TABLE rollout_marks (
            mark_id TEXT PRIMARY KEY,
            rollout_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            at REAL NOT NULL,
            reason TEXT NOT NULL
        );
        CREATE INDEX rollout_marks_rollout ON rollout_marks (rollout_id, kind);
        """,
    ),
    (
        10,
        # managed client keys (gateway/keys/store.py): the keys (hashed), usage per key and
        # UTC day (open reservations included), and the counted requests of the last minutes.
        """        CREATE TABLE client_keys (
            key_id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            prefix TEXT NOT NULL,
            secret_hash TEXT NOT NULL UNIQUE,
            limits TEXT NOT NULL,
            metadata TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            revoked_at REAL
        );
        CREATE TABLE client_key_usage (
            key_id TEXT NOT NULL,
            day TEXT NOT NULL,
            requests INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            PRIMARY KEY (key_id, day)
        );
        CREATE TABLE client_key_requests (
            request_id TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            at REAL NOT NULL,
            day TEXT NOT NULL,
            reserved INTEGER NOT NULL,
            used INTEGER NOT NULL,
            open INTEGER NOT NULL
        );
        CREATE INDEX client_key_requests_key ON client_key_requests (key_id, at);
        """,
    ),
    (
        11,
        # rollout owners (gateway/rollout/owners.py): the client identity whose first
        # recorded call claimed a rollout id, and when an admin deleted it (the id is not
        # taken again for a grace period).
        """
        CREATE TABLE rollout_owners (
            rollout_id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at REAL NOT NULL,
            deleted_at REAL
        );
        """,
    ),
    (
        12,
        # a reservation's lease (gateway/keys/store.py): until when its process vouches for
        # it (renewed while the request runs); an open row past it is reclaimed by the next
        # reservation of its key (reclaimed = 1 until its settlement arrives). NULL: a row
        # from before (taken as lost an hour on).
        """
        ALTER TABLE client_key_requests ADD COLUMN lease_until REAL;
        ALTER TABLE client_key_requests ADD COLUMN reclaimed INTEGER NOT NULL DEFAULT 0;
        """,
    ),
    (
        13,
        # an operator's label for an admin-added credential (gateway/upstream/credential.py)
        """
        ALTER TABLE credentials ADD COLUMN label TEXT;
        """,
    ),
    (
        14,
        # a trainer's labels on rollouts (gateway/rollout/labels.py): rewards, one per rollout
        # (call_id '') and one per call, upserted by (rollout, call); the group of a rollout
        # (GRPO groups the rollouts of one prompt).
        """
        CREATE TABLE rollout_rewards (
            reward_id TEXT PRIMARY KEY,
            rollout_id TEXT NOT NULL,
            call_id TEXT NOT NULL,
            reward REAL NOT NULL,
            details TEXT,
            at REAL NOT NULL
        );
        CREATE INDEX rollout_rewards_rollout ON rollout_rewards (rollout_id);
        CREATE TABLE rollout_groups (
            rollout_id TEXT PRIMARY KEY,
            group_id TEXT NOT NULL,
            at REAL NOT NULL
        );
        CREATE INDEX rollout_groups_group ON rollout_groups (group_id);
        """,
    ),
    (
        15,
        # money budgets of managed keys (gateway/keys/quota.py, budget_cost): what each day
        # cost and what each reservation holds and used, in nano-units of the price table's
        # currency (integers: sums stay exact on both dialects)
        """
        ALTER TABLE client_key_usage ADD COLUMN cost_nanos INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE client_key_requests ADD COLUMN reserved_cost INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE client_key_requests ADD COLUMN used_cost INTEGER NOT NULL DEFAULT 0;
        """,
    ),
]

_PG_TYPES = ((re.compile(r"\bREAL\b"), "DOUBLE PRECISION"), (re.compile(r"\bINTEGER\b"), "BIGINT"))


def ddl(migration: str | dict[str, str], dialect: str) -> str:
    """A migration's SQL for ``dialect`` ("sqlite" or "postgres")."""
    if isinstance(migration, dict):
        return migration.get(dialect, "")
    if dialect == "postgres":
        for pattern, replacement in _PG_TYPES:
            migration = pattern.sub(replacement, migration)
    return migration
