-- Kept for an API key revocation NOTIFY (every replica evicting the key from its cache), and
-- left empty: the scheduler no longer caches keys (auth.py). Every call reads api_keys, so a
-- revoked key is refused by the next call on every replica; a NOTIFY would still have left the
-- window between the revoking commit and its delivery to the other replicas, and a channel no
-- replica needs is what 0004 removed. The number stays so that migrations remain 1..n.

SELECT 1;  -- a migration must run a statement
