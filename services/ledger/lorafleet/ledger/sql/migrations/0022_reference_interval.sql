-- The checkpoint interval a lease is judged by when it has none of its own, named where
-- lorafleet_lease_interval had a bare 100. It applies under a spec with checkpointing_steps
-- auto (0) and a lease with no chosen interval, which only a lease granted before 0018 can be
-- (the scheduler records its choice at every grant, set_lease_interval, and sends no grant it
-- could not choose for). 100 steps was the spec's fixed default before auto, and it is the
-- interval the stall bound is stated for (stall_leases, the scheduler's
-- lease_progress_timeout_s).
CREATE FUNCTION lorafleet_reference_interval() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT 100
$$;

CREATE OR REPLACE FUNCTION lorafleet_lease_interval(spec jsonb, lease_steps integer)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN coalesce(lease_steps, 0) > 0 THEN lease_steps
                WHEN coalesce((spec ->> 'checkpointing_steps')::int, 0) > 0
                    THEN (spec ->> 'checkpointing_steps')::int
                ELSE lorafleet_reference_interval() END
$$;
