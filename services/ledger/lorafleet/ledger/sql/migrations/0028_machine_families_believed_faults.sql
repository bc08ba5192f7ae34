-- The model families a machine serves, as its Hello announces them (upsert_machine): a queued
-- job's waiting reason counts only machines of the job's family as able to run it.
ALTER TABLE machines ADD COLUMN families text[] NOT NULL DEFAULT '{}';

-- Whether the fleet believed the failure that ended a lease (fail_attempt): an INTERNAL error
-- counted against the job (from a machine the operator runs, or one in good standing for it),
-- or a confirmed input fault. Such a lease is not empty toward its machine's quarantine: ten
-- lorafleet bugs on `lorafleet up`'s only worker must not quarantine it. A claim the fleet did
-- not believe still counts: saying INTERNAL about every job gets no stranger's machine around
-- the quarantine.
ALTER TABLE leases ADD COLUMN fault_believed boolean NOT NULL DEFAULT false;

-- Whether machine $1 is one of the operator's own: vouched for on its current stream by one
-- of the providers $2 (lorafleet up's local supervisor, EC2 in the operator's account).
CREATE FUNCTION lorafleet_operator_run(machine text, operator_providers text[]) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM machines m
                   WHERE m.machine_id = machine AND m.identity_provider = ANY (operator_providers))
$$;

CREATE OR REPLACE FUNCTION lorafleet_empty_leases(machine text, window_s float8) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM leases q
    WHERE q.machine_id = machine
      AND q.end_reason IN ('dropped', 'drained', 'expired', 'failed: input', 'failed: internal')
      AND q.ended_at > now() - make_interval(secs => window_s)
      AND NOT q.fault_believed
      AND NOT EXISTS (SELECT 1 FROM checkpoints c
                      WHERE c.job_id = q.job_id AND c.epoch = q.epoch)
      AND NOT (q.end_reason = 'failed: input'
               AND EXISTS (SELECT 1 FROM jobs j
                           WHERE j.job_id = q.job_id AND j.state = 'FAILED'
                             AND j.failure_class = 'INPUT'
                             AND j.node_faults < j.max_node_faults))
$$;

CREATE OR REPLACE FUNCTION lorafleet_waits_on_quarantine(job uuid, need_mb bigint,
                                                         fault_threshold integer,
                                                         window_s float8,
                                                         empty_lease_limit integer)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT coalesce(bool_and(lorafleet_quarantined(m.machine_id, fault_threshold, window_s,
                                                   empty_lease_limit)), false)
    FROM machines m
    WHERE m.session_token_sha256 IS NOT NULL
      AND m.last_seen_at > now() - make_interval(secs => window_s)
      AND m.qualified AND m.vram_mb >= need_mb
      AND (SELECT j.family FROM jobs j WHERE j.job_id = job) = ANY (m.families)
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = job AND b.machine_id = m.machine_id)
$$;
