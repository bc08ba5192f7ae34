-- The checkpoint interval of the live lease, where the scheduler chose it (checkpointing_steps
-- auto, stored as 0 in the spec): the stall bound and the progress rule use the interval the
-- holder was told, not the spec's 0. NULL under a spec with a fixed interval.
ALTER TABLE jobs ADD COLUMN lease_checkpoint_steps integer;
-- The highest step the live lease committed (NULL until its first checkpoint): its progress
-- is measured from its own checkpoints, not from the job's newest, which an earlier holder may
-- have set to a bogus high step.
ALTER TABLE jobs ADD COLUMN lease_progress_step bigint;

-- Steps between a job's checkpoints under its live lease: the lease's chosen interval, else
-- the spec's; 100 (the former default) for an unresolved auto or an older spec.
CREATE FUNCTION lorafleet_lease_interval(spec jsonb, lease_steps integer) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN coalesce(lease_steps, 0) > 0 THEN lease_steps
                WHEN coalesce((spec ->> 'checkpointing_steps')::int, 0) > 0
                    THEN (spec ->> 'checkpointing_steps')::int
                ELSE 100 END
$$;

DROP FUNCTION lorafleet_checkpoint_interval(jsonb);

-- A lease that ended failed (input or internal, as its holder said) with no checkpoint is
-- empty too: saying JobFailed instead of Ready must not get around the quarantine.
CREATE OR REPLACE FUNCTION lorafleet_empty_leases(machine text, window_s float8) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM leases q
    WHERE q.machine_id = machine
      AND q.end_reason IN ('dropped', 'drained', 'expired', 'failed: input', 'failed: internal')
      AND q.ended_at > now() - make_interval(secs => window_s)
      AND NOT EXISTS (SELECT 1 FROM checkpoints c
                      WHERE c.job_id = q.job_id AND c.epoch = q.epoch)
$$;

-- When a job last entered the queue (its submit, or its last re-queue): the warm-dispatch
-- fairness bound counts from here (claim_job), without a look into the job's leases. Kept by
-- a trigger, so every statement that re-queues a job keeps it, present and future.
ALTER TABLE jobs ADD COLUMN queued_at timestamptz NOT NULL DEFAULT now();
UPDATE jobs SET queued_at = coalesce(
    (SELECT max(l.ended_at) FROM leases l WHERE l.job_id = jobs.job_id), created_at);

CREATE FUNCTION lorafleet_mark_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'QUEUED' AND OLD.state IS DISTINCT FROM 'QUEUED' THEN
        NEW.queued_at := now();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_mark_queued BEFORE UPDATE OF state ON jobs
FOR EACH ROW EXECUTE FUNCTION lorafleet_mark_queued();
