-- The fleet's pace comes from what the scheduler observed (verified checkpoints, verified
-- results), no longer from the pace a worker reports: the scaler reads every recent lease by
-- its grant time, and estimates read the leases that ended with a result by their end.
DROP INDEX leases_paced_idx;
CREATE INDEX leases_granted_idx ON leases (granted_at);
CREATE INDEX leases_succeeded_idx ON leases (ended_at) WHERE end_reason = 'succeeded';
