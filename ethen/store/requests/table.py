"""The request log's tables (issue 14) and the migrations that create them: ``request_log``, one row per
finished gateway request (:data:`COLUMNS`: when it arrived, its request id, project, key id (never the
key), endpoint, requested model, the selected and primary candidate, the attempts, whether a fallback served
it, the canary hit, tokens (of the prompt's, those read from and written to the provider's prompt cache:
migration ``0010``), cost and what the cache reads saved (nano-USD), TTFT, total latency, the HTTP status,
the outcome and error code, and the full ``ethen.routing`` receipt (JSON)), and ``request_attempts``.

- The ids are 64-bit on Postgres (``BIGSERIAL``): pruning never resets them.
- Attempts (issue 14, the dashboard's Candidates page): each row's attempts are also stored one per row in
  :data:`request_attempts` (log id, attempt index, ``at`` as epoch seconds, candidate, provider, model,
  outcome, status, latency), written in the same transaction as the log rows, so the page reads narrow
  columns instead of unnesting 10k JSON lists (``ethen.store.requeststats``). Migration
  ``0007_request_attempts`` backfills them from the rows already logged (in SQL: one statement). Attempts
  without a candidate id are not stored there (the page skipped them before, too).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    text,
)

__all__ = [
    "ATTEMPT_COLUMNS",
    "COLUMNS",
    "create_request_attempts",
    "create_request_log",
    "request_attempts",
    "request_log",
]

_metadata = MetaData()
_ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only

request_log = Table(
    "request_log",
    _metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("endpoint", String(20), nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("project", String(100), nullable=True),
    Column("key_id", String(120), nullable=True),
    Column("requested_model", String(200), nullable=True),
    Column("selected_provider", String(100), nullable=True),
    Column("selected_model", String(200), nullable=True),
    Column("primary_provider", String(100), nullable=True),
    Column("primary_model", String(200), nullable=True),
    Column("fallback_used", Boolean, nullable=False),
    Column("canary_hit", Boolean, nullable=True),
    Column("prompt_tokens", BigInteger, nullable=True),
    Column("completion_tokens", BigInteger, nullable=True),
    Column("cost_nano", BigInteger, nullable=True),
    # 0010 (issue 45): of prompt_tokens, read from / written to the provider's prompt cache, and what the
    # reads saved (nano-USD; ``ethen.gateway.accounting.pricing``); NULL on rows logged before
    Column("cache_read_tokens", BigInteger, nullable=True),
    Column("cache_write_tokens", BigInteger, nullable=True),
    Column("saved_nano", BigInteger, nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("latency_ms", Float, nullable=False),
    Column("overhead_ms", Float, nullable=True),
    Column("status", Integer, nullable=False),
    Column("outcome", String(20), nullable=False),
    Column("error_code", String(100), nullable=True),
    Column("attempts", JSON, nullable=False),
    Column("receipt", JSON, nullable=True),
    Index("ix_request_log_request_id", "request_id"),
    Index("ix_request_log_at", "at"),
    Index("ix_request_log_project", "project", "id"),
)

#: the columns of a row, as inserted (``id`` is assigned by the database)
COLUMNS = tuple(c.name for c in request_log.columns if c.name != "id")
assert COLUMNS[1] == "at" and COLUMNS[-2:] == ("attempts", "receipt"), COLUMNS  # encode_row's layout

#: One row per attempt of a logged request (``log_id``: its ``request_log.id``; ``seq``: its index in the
#: row's attempts; ``at_s``: the row's ``at`` as epoch seconds, a plain float the page buckets directly).
request_attempts = Table(
    "request_attempts",
    _metadata,
    Column("log_id", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("at_s", Float, nullable=False),
    Column("candidate", String, nullable=False),
    Column("provider", String, nullable=False),
    Column("model", String, nullable=False),
    Column("outcome", String, nullable=False),
    Column("status", Integer, nullable=True),
    Column("latency_ms", Float, nullable=True),
    Index("ix_request_attempts_at_s", "at_s"),
)

#: the columns of an attempt row, in the order of :attr:`EncodedRow.attempts` (after ``log_id``)
ATTEMPT_COLUMNS = tuple(c.name for c in request_attempts.columns)


def create_request_log(conn: Connection) -> None:
    """The migration that creates the table (``ethen.store.migrations``)."""
    _metadata.create_all(conn, tables=[request_log])


#: the backfill of ``0007``: every attempt with a candidate id of the rows already logged (the same
#: extraction the Candidates page made with ``json_each`` / ``json_array_elements`` before the table)
_BACKFILL = {
    "sqlite": """
INSERT INTO request_attempts (log_id, seq, at_s, candidate, provider, model, outcome, status, latency_ms)
SELECT r.id, j.key, CAST(strftime('%s', r.at) AS INTEGER) + CAST(substr(r.at, 20) AS REAL),
       json_extract(j.value, '$.candidate'),
       coalesce(nullif(json_extract(j.value, '$.provider'), ''),
                CASE WHEN instr(json_extract(j.value, '$.candidate'), '/') > 0
                     THEN substr(json_extract(j.value, '$.candidate'), 1,
                                 instr(json_extract(j.value, '$.candidate'), '/') - 1)
                     ELSE json_extract(j.value, '$.candidate') END),
       coalesce(json_extract(j.value, '$.model'), ''),
       coalesce(json_extract(j.value, '$.outcome'), ''),
       CASE WHEN json_type(j.value, '$.status') = 'integer' THEN json_extract(j.value, '$.status') END,
       CASE WHEN json_type(j.value, '$.latency_ms') IN ('integer', 'real')
            THEN json_extract(j.value, '$.latency_ms') END
FROM request_log AS r, json_each(r.attempts) AS j
WHERE j.type = 'object' AND json_type(j.value, '$.candidate') = 'text'
  AND json_extract(j.value, '$.candidate') != ''""",
    "postgresql": """
INSERT INTO request_attempts (log_id, seq, at_s, candidate, provider, model, outcome, status, latency_ms)
SELECT r.id, j.n - 1, extract(epoch FROM r.at)::float8, j.value ->> 'candidate',
       coalesce(nullif(j.value ->> 'provider', ''), split_part(j.value ->> 'candidate', '/', 1)),
       coalesce(j.value ->> 'model', ''),
       coalesce(j.value ->> 'outcome', ''),
       CASE WHEN json_typeof(j.value -> 'status') = 'number'
            AND (j.value ->> 'status') ~ '^-?[0-9]{1,9}$' THEN (j.value ->> 'status')::int END,
       CASE WHEN json_typeof(j.value -> 'latency_ms') = 'number' THEN (j.value ->> 'latency_ms')::float8 END
FROM request_log AS r,
     json_array_elements(CASE WHEN json_typeof(r.attempts) = 'array' THEN r.attempts ELSE '[]' END)
       WITH ORDINALITY AS j(value, n)
WHERE json_typeof(j.value) = 'object' AND json_typeof(j.value -> 'candidate') = 'string'
  AND j.value ->> 'candidate' != ''""",
}


def create_request_attempts(conn: Connection) -> None:
    """Migration ``0007_request_attempts``: the attempts table, backfilled from the rows already logged."""
    _metadata.create_all(conn, tables=[request_attempts])
    conn.execute(text(_BACKFILL[conn.dialect.name]))
