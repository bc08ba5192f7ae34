-- The scaler's view (DESIGN.md): the node registry and the scaler's decisions.
-- * The registry is `machines` (fed by each worker's Hello) with what the leases say about a
--   machine: its live lease (jobs), its node faults and finished jobs (leases.end_reason), and
--   its pace: each lease keeps the worker's latest seconds per step and the first and last
--   step it heartbeated (the heartbeat query writes them), so that steps run past warm-up and
--   seconds per step can be compared by job shape.
-- * Every decision of the active scaler is a row: what, on which instance or machine, why,
--   the figures behind it, whether it was carried out and the error if not. A HOLD repeated
--   tick after tick folds into one row (`repeats`, `last_at`).

ALTER TABLE leases ADD COLUMN seconds_per_step real;
ALTER TABLE leases ADD COLUMN first_step bigint;
ALTER TABLE leases ADD COLUMN last_step bigint;
CREATE INDEX leases_paced_idx ON leases (granted_at) WHERE seconds_per_step IS NOT NULL;
CREATE INDEX leases_node_fault_idx ON leases (machine_id, ended_at)
    WHERE end_reason = 'failed: node';

-- When the work last ran out: the newest finish.
CREATE INDEX jobs_finished_idx ON jobs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE scaler_decisions (
    decision_id bigserial PRIMARY KEY,
    -- The scaler's clock (the policy's `now`); last_at moves when a HOLD repeats.
    at          timestamptz NOT NULL,
    last_at     timestamptz NOT NULL,
    repeats     integer NOT NULL DEFAULT 1,
    scaler_id   text NOT NULL,
    action      text NOT NULL
        CHECK (action IN ('scale', 'reallocate', 'restart', 'drop_lease', 'set_deletion_cost',
                          'hold')),
    -- 'fleet', an instance id, a machine id (drop_lease) or a job id (a stranded job's hold).
    target      text NOT NULL,
    job_id      uuid,
    reason      text NOT NULL,
    figures     jsonb NOT NULL DEFAULT '{}',
    -- HOLDs with the same key in a row on one target are one row.
    fold_key    text NOT NULL DEFAULT '',
    applied     boolean NOT NULL DEFAULT false,
    error       text
);
CREATE INDEX scaler_decisions_target_idx ON scaler_decisions (target, decision_id);
CREATE INDEX scaler_decisions_at_idx ON scaler_decisions (at);
