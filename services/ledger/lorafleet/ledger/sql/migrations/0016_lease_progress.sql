-- A lease must make verified progress (a checkpoint the store verified, crossing the job's
-- checkpoint interval) within a bound, or the sweeper revokes it as a node fault
-- (stall_leases): heartbeats alone keep a lease alive but are no progress. Set at every grant
-- and every such checkpoint; leases live when this runs start their bound now.
ALTER TABLE jobs ADD COLUMN lease_progress_at timestamptz;
UPDATE jobs SET lease_progress_at = now() WHERE state = 'RUNNING';

-- Steps between a job's checkpoints, from its spec (the default for older specs, never 0).
CREATE FUNCTION lorafleet_checkpoint_interval(spec jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(1, coalesce((spec ->> 'checkpointing_steps')::int, 100))
$$;
