-- A per-key spend limit (issue 16): a submit whose estimated cost would take the key's jobs past
-- it is refused. NULL: no limit.
ALTER TABLE api_keys ADD COLUMN spend_limit_dollars double precision
    CHECK (spend_limit_dollars IS NULL OR spend_limit_dollars >= 0);
