-- Workers are strangers' machines (DESIGN.md, "Trust"):
-- * resuming a lease after a reconnect takes the secret its grant carried (only its digest
--   is stored; users never see it);
-- * a machine id belongs to one stream at a time: a new stream must present the previous
--   one's session token, or wait until that machine has been silent for a lease TTL;
-- * replicas say they are alive, so one that starts after an outage of every replica can give
--   workers a lease TTL to reconnect before their leases expire.

ALTER TABLE leases ADD COLUMN secret_sha256 bytea;
ALTER TABLE machines ADD COLUMN session_token_sha256 bytea;

CREATE TABLE scheduler_replicas (
    replica_id   text PRIMARY KEY,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
