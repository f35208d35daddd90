-- redeliver inbox, version 1: one row per (consumer, message id) processed.
-- {schema}, {table} and {processed_at_index} are replaced by quoted identifiers.
CREATE TABLE IF NOT EXISTS {schema}.{table} (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {processed_at_index} ON {schema}.{table} (processed_at);
