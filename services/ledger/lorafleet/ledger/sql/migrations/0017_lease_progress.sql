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

-- Leases of machine $1 that ended in the last $2 s without work: given up by a Ready, drained
-- or expired with no checkpoint recorded under them. Past a limit the machine is granted
-- nothing (claim_job): taking and dropping leases is how a stream collects their URLs.
CREATE FUNCTION lorafleet_empty_leases(machine text, window_s float8) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM leases q
    WHERE q.machine_id = machine AND q.end_reason IN ('dropped', 'drained', 'expired')
      AND q.ended_at > now() - make_interval(secs => window_s)
      AND NOT EXISTS (SELECT 1 FROM checkpoints c
                      WHERE c.job_id = q.job_id AND c.epoch = q.epoch)
$$;
