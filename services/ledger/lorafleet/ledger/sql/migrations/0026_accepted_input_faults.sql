-- A lease that ended in an input fault the fleet accepted as the job's (the job failed as
-- INPUT by fail_attempt's confirmation: an operator-run machine's word, or two machines in
-- good standing) is the user's fault, not an empty lease toward its machine's quarantine: ten
-- bad specs on `lorafleet up` quarantined its only worker for an hour. A job that failed at
-- max_node_faults (its last attempt an unconfirmed input fault) is not accepted: a confirmed
-- failure counts no node fault, so such a job has node_faults < max_node_faults. An input
-- fault the fleet did not accept still counts: calling every input bad must not get a hostile
-- machine around the quarantine.
CREATE OR REPLACE FUNCTION lorafleet_empty_leases(machine text, window_s float8) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM leases q
    WHERE q.machine_id = machine
      AND q.end_reason IN ('dropped', 'drained', 'expired', 'failed: input', 'failed: internal')
      AND q.ended_at > now() - make_interval(secs => window_s)
      AND NOT EXISTS (SELECT 1 FROM checkpoints c
                      WHERE c.job_id = q.job_id AND c.epoch = q.epoch)
      AND NOT (q.end_reason = 'failed: input'
               AND EXISTS (SELECT 1 FROM jobs j
                           WHERE j.job_id = q.job_id AND j.state = 'FAILED'
                             AND j.failure_class = 'INPUT'
                             AND j.node_faults < j.max_node_faults))
$$;
