-- redeliver outbox, version 1: messages stored by a transaction, published after its commit.
-- {schema} and {table} are replaced by quoted identifiers.
CREATE TABLE IF NOT EXISTS {schema}.{table} (
    id           bigserial   PRIMARY KEY,
    message_id   text        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    body         bytea       NOT NULL,
    content_type text        NULL,
    -- User headers: a JSON object of string values.
    headers      jsonb       NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
