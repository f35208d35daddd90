-- redeliver outbox, version 2: a row the broker refuses is retried with backoff, then parked.
-- {schema} and {table} are replaced by quoted identifiers.
--   attempts         publishes of the row the broker refused (returned, nacked, 404, timed out)
--   next_attempt_at  not taken by a relay before then; NULL: due now
--   last_error       why the last attempt failed, as the relay saw it
--   parked_at        set when the relay gave up (policy exhausted, or a row that can never be
--                    published); a parked row waits for an operator: `redeliver outbox parked`
--   parked_reason    retries_exhausted, permanent, unreadable
ALTER TABLE {schema}.{table}
    ADD COLUMN IF NOT EXISTS attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz NULL,
    ADD COLUMN IF NOT EXISTS last_error      text        NULL,
    ADD COLUMN IF NOT EXISTS parked_at       timestamptz NULL,
    ADD COLUMN IF NOT EXISTS parked_reason   text        NULL;
-- The relay's round walks the rows not parked in id order; the operator's commands read the
-- parked ones. Both stay index scans however many rows wait on the other side. Unnamed:
-- PostgreSQL picks names that collide with nothing, whatever the table's name (a migration
-- runs once, recorded in schema_migrations).
CREATE INDEX ON {schema}.{table} (id) WHERE parked_at IS NULL;
CREATE INDEX ON {schema}.{table} (id) WHERE parked_at IS NOT NULL;
