-- A job's failure budget is the job's. `failures` counts only attempts the job can be blamed
-- for (an input fault a second machine confirmed, or an internal error reported by machines in
-- good standing); every other failed attempt (node faults, a stall, an error from a machine
-- not in good standing) counts in `node_faults`, bounded apart by `max_node_faults`, larger
-- than any few machines can spend: each machine is banned from a job after failing it once.
ALTER TABLE jobs ADD COLUMN node_faults integer NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN max_node_faults integer
    GENERATED ALWAYS AS (greatest(10, 3 * max_failures)) STORED;

-- A machine in good standing: a provider vouched for it, and it delivered a verified result
-- of its own since its last node fault (a machine failing everything, quarantined or not, has
-- none). Only such machines' internal errors are blamed on a job; checked when the job's
-- budget is decided, so attempts on a machine that has gone bad since count for nothing.
CREATE FUNCTION lorafleet_good_standing(machine text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM machines m
                   WHERE m.machine_id = machine AND m.identity_provider <> '')
       AND coalesce((SELECT max(s.ended_at) FROM leases s
                     WHERE s.machine_id = machine AND s.end_reason = 'succeeded')
                    > coalesce((SELECT max(q.ended_at) FROM leases q
                                WHERE q.machine_id = machine AND q.end_reason = 'failed: node'),
                               '-infinity'), false)
$$;

-- The reference pace per GPU class, in seconds per 1024x1024 image step (scaled to a job's
-- shape like the prior): what the scaler judges a node slow against, beside its live peers.
-- Learned only from machines that have been in the fleet for hours, and moved at a bounded
-- rate per hour (scaler/policy.py, "Slow node"); an operator may pin a class instead
-- (LORAFLEET_REFERENCE_PACES), and then this row is not read.
CREATE TABLE pace_references (
    gpu_class        text PRIMARY KEY,
    seconds_per_step float8 NOT NULL CHECK (seconds_per_step > 0),
    machines         integer NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
