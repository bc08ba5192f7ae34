-- Every query the scheduler runs. Each starts with `-- name: <method>`; the Ledger class has
-- one method per query, and titled sections (`-- Title ---`) group them as the Ledger's bases
-- do (one mixin per section, `lorafleet/ledger/sections/`), with the same titles in the same
-- order (tests/scheduler/test_ledger_sections.py).
-- Worker-facing writes are fenced: they only touch the job while (lease_id, epoch) is still
-- its live lease.

-- API keys ---------------------------------------------------------------------------------------

-- name: insert_api_key
-- $1 key id, $2 owner, $3 the secret's sha256, $4 webhook URL (NULL: none), $5 the webhook's
-- event kinds, $6 spend limit in dollars (NULL: none).
INSERT INTO api_keys (key_id, owner, secret_sha256, webhook_url, webhook_events,
                      spend_limit_dollars)
VALUES ($1, $2, $3, $4, $5, $6)
RETURNING webhook_secret;

-- name: key_spending
-- A key's spend limit (NULL: none) and the GPU-seconds billed so far to the jobs it submitted.
SELECT k.spend_limit_dollars,
       coalesce((SELECT sum(lorafleet_gpu_seconds(j.job_id)) FROM jobs j
                 WHERE j.api_key_id = k.key_id), 0)::float8 AS gpu_seconds
FROM api_keys k WHERE k.key_id = $1;

-- name: key_unfinished_work
-- The steps still to run of a key's queued and running jobs, by job shape (what its spend limit
-- counts besides the GPU-seconds already billed): per shape key (JobSpec.shape.key, 0020), one
-- of its specs, from which the shape is read again. A job without a key yet (submitted by an
-- older replica) is a shape of its own.
SELECT (array_agg(spec))[1] AS spec,
       sum(greatest(max_train_steps - progress_step, 0))::bigint AS steps
FROM jobs
WHERE api_key_id = $1 AND state IN ('QUEUED', 'RUNNING')
GROUP BY coalesce(shape_key, job_id::text)
LIMIT 1000;

-- name: get_api_key
SELECT key_id, owner, secret_sha256 FROM api_keys WHERE key_id = $1 AND revoked_at IS NULL;

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now() WHERE key_id = $1 AND revoked_at IS NULL RETURNING key_id;

-- name: list_api_keys
SELECT key_id, owner, created_at, revoked_at, webhook_url FROM api_keys ORDER BY created_at, key_id;

-- Fleet figures: paces and interruptions ---------------------------------------------------------

-- name: pace_for_shape
-- The fleet's pace on jobs of one shape ($2 its key: JobSpec.shape.key, stored at submit as
-- jobs.shape_key), from verified completions only: leases that ended in the last $1 s
-- with a result the store verified, each as the ledger's own clock from grant to end over the
-- steps the lease had to run (max_train_steps less the checkpoint it resumed from: nothing a
-- worker said). Only machines a provider vouched for count, each once (the median of its
-- leases), so that one machine moves the figure no more than any other; then the median over
-- machines, and how many machines it rests on. A completion faster than $3 s/step (the
-- plausibility floor for the shape) is no training (a garbage result stored fast): left out.
-- $4: only jobs submitted with this API key (a tenant's own figure, JobHandler.pace); '' all.
WITH done AS (
    SELECT l.machine_id,
           extract(epoch FROM l.ended_at - l.granted_at)::float8
               / nullif(j.max_train_steps - coalesce(g.step, 0), 0) AS seconds_per_step
    FROM leases l
    JOIN jobs j ON j.job_id = l.job_id
    JOIN machines m ON m.machine_id = l.machine_id AND m.identity_provider <> ''
    LEFT JOIN LATERAL (
        SELECT e.step FROM job_events e
        WHERE e.job_id = l.job_id AND e.lease_id = l.lease_id AND e.kind = 'LEASE_GRANTED'
        LIMIT 1
    ) g ON true
    WHERE l.end_reason = 'succeeded' AND l.ended_at > now() - make_interval(secs => $1)
      AND j.shape_key = $2
      AND ($4::text = '' OR j.api_key_id = $4::text)
), per_machine AS (
    SELECT machine_id,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds_per_step) AS seconds_per_step
    FROM done WHERE seconds_per_step > 0 AND seconds_per_step >= $3::float8
    GROUP BY machine_id
)
SELECT count(*) AS machines,
       coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds_per_step), 0)::float8
           AS seconds_per_step
FROM per_machine;

-- name: interruptions_for_gpu
-- How often leases on one node class ($2 gpu_model) were interrupted over the last $1 s:
-- leases ended by expiry (the scheduler's own clock) or drain (a preemption notice, a SIGTERM),
-- against the seconds leases were held (running ones so far). Machines a provider vouched for
-- only: a self-declared machine moves no one's checkpoint interval. Each machine counts at most
-- one interruption in the window, whatever it did: one machine draining and reconnecting in a
-- loop moves the class's mean time between interruptions by at most 2x, its interval by
-- sqrt(2), and never another machine's count. On SaladCloud and spot VMs an interruption
-- usually ends a machine's life (the next instance has a new id), so little is lost.
WITH per_machine AS (
    SELECT least(count(*) FILTER (WHERE l.end_reason IN ('expired', 'drained')), 1)::float8
               AS interruptions,
           coalesce(sum(extract(epoch FROM coalesce(l.ended_at, now()) - l.granted_at)), 0)::float8
               AS lease_seconds
    FROM leases l JOIN machines m ON m.machine_id = l.machine_id
    WHERE m.gpu_model = $2 AND m.identity_provider <> ''
      AND l.granted_at > now() - make_interval(secs => $1)
    GROUP BY l.machine_id
)
SELECT coalesce(sum(interruptions), 0)::float8 AS interruptions,
       coalesce(sum(lease_seconds), 0)::float8 AS lease_seconds
FROM per_machine;

-- Jobs -------------------------------------------------------------------------------------------

-- name: insert_jobs
-- $1 owner; then one array per column, one element per job: $2 job ids, $3 idempotency keys
-- ('' none), $4 specs, $5 priorities, $6 memory needs, $7 max_failures, $8 max_train_steps,
-- $9 labels, $10 traceparents ('' none); $11 the submitting API key; $12,
-- $13 and $14 the spec's warm keys (JobSpec.resident_key, compiled_shape_key,
-- adapter_shape_key); $15 its family, $16 its shape key (JobSpec.family, shape.key). $6 is the
-- job's memory need (core/fit.py), not only the spec's min_vram_mb. Rows whose
-- idempotency key the owner already used are skipped here and read back by
-- get_jobs_by_idempotency_key.
WITH input AS (
    SELECT * FROM unnest($2::uuid[], $3::text[], $4::jsonb[], $5::int[], $6::int[], $7::int[],
                         $8::int[], $9::jsonb[], $10::text[], $12::text[], $13::text[],
                         $14::text[], $15::text[], $16::text[])
        AS t (job_id, idempotency_key, spec, priority, min_vram_mb, max_failures,
              max_train_steps, labels, traceparent, resident_key, compiled_shape_key,
              adapter_shape_key, family, shape_key)
), inserted AS (
    INSERT INTO jobs (job_id, owner, idempotency_key, spec, state, priority, min_vram_mb,
                      max_failures, max_train_steps, labels, traceparent, api_key_id,
                      resident_key, compiled_shape_key, adapter_shape_key, family, shape_key)
    SELECT job_id, $1, NULLIF(idempotency_key, ''), spec, 'QUEUED', priority, min_vram_mb,
           max_failures, max_train_steps, labels, NULLIF(traceparent, ''), $11,
           resident_key, compiled_shape_key, adapter_shape_key, family, shape_key
    FROM input
    ON CONFLICT (owner, idempotency_key) DO NOTHING
    RETURNING *
), submitted AS (
    INSERT INTO job_events (job_id, kind, state)
    SELECT job_id, 'SUBMITTED', 'QUEUED' FROM inserted
)
SELECT * FROM inserted;

-- name: jobs_without_warm_keys
-- Unfinished jobs submitted before 0016 or 0019, and any job submitted before 0020 (its shape
-- key: finished jobs' paces price and time later ones): their keys are computed from the spec
-- in Python.
SELECT job_id, spec FROM jobs
WHERE ((resident_key IS NULL OR adapter_shape_key IS NULL) AND state IN ('QUEUED', 'RUNNING'))
   OR shape_key IS NULL
LIMIT $1;

-- name: set_warm_keys
-- Fills the warm keys of jobs submitted before a column existed: one array per column, one
-- element per job: $1 job ids, $2 resident keys, $3 compiled shape keys, $4 adapter shape keys,
-- $5 shape keys.
UPDATE jobs j SET resident_key = k.resident_key, compiled_shape_key = k.compiled_shape_key,
                  adapter_shape_key = k.adapter_shape_key, shape_key = k.shape_key
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[])
    AS k (job_id, resident_key, compiled_shape_key, adapter_shape_key, shape_key)
WHERE j.job_id = k.job_id
  AND (j.resident_key IS NULL OR j.adapter_shape_key IS NULL OR j.shape_key IS NULL);

-- name: get_jobs_by_idempotency_key
SELECT * FROM jobs WHERE owner = $1 AND idempotency_key = ANY($2::text[]);

-- name: get_job
-- $1 job, $2 owner; $3, $4, $5 the quarantine's bounds (lorafleet_waiting_reason).
SELECT j.*, lorafleet_gpu_seconds(j.job_id) AS gpu_seconds,
    lorafleet_waiting_reason(j.job_id, $3::int, $4::float8, $5::int) AS waiting_reason
FROM jobs j WHERE j.job_id = $1 AND j.owner = $2;

-- name: get_job_any_owner
SELECT * FROM jobs WHERE job_id = $1;

-- name: list_jobs
-- $1 owner, $2 states (empty: all), $3 labels the job must carry ('{}' matches every job),
-- $4 and $5 the (created_at, job_id) of the last job of the previous page (NULL: the first
-- page: keyset pagination, newest first), $6 page size; $7, $8 and $9 the quarantine (as
-- get_job's $3, $4, $5).
SELECT j.*, lorafleet_gpu_seconds(j.job_id) AS gpu_seconds,
    lorafleet_waiting_reason(j.job_id, $7::int, $8::float8, $9::int) AS waiting_reason
FROM jobs j
WHERE owner = $1
  AND (cardinality($2::text[]) = 0 OR state = ANY($2::text[]))
  AND labels @> $3::jsonb
  AND ($4::timestamptz IS NULL OR (created_at, job_id) < ($4::timestamptz, $5::uuid))
ORDER BY created_at DESC, job_id DESC
LIMIT $6;

-- name: lock_job
-- Waits for a claim in flight on job $1 to commit (Ledger.cancel_job; see cancel_job).
SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE;

-- name: cancel_job
-- Run after lock_job in the same transaction: a claim that committed while this statement
-- waited for the job's row would otherwise be re-read in `target` (the new lease id) but its
-- new leases row would be invisible to `ended`, and stay open (billed) for ever.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE job_id = $1 AND owner = $2 AND state IN ('QUEUED', 'RUNNING')
    FOR UPDATE
), canceled AS (
    UPDATE jobs j
    SET state = 'CANCELED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        error = 'canceled by its owner', finished_at = now(), updated_at = now()
    FROM target t WHERE j.job_id = t.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'canceled'
    FROM target t WHERE l.lease_id = t.lease_id
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch)
    SELECT job_id, 'CANCELED', 'CANCELED', lease_id, machine_id, epoch FROM target
)
SELECT * FROM canceled;

-- Leases (the worker stream) ---------------------------------------------------------------------

-- name: claim_job
-- One statement: pick the best claimable job for this machine, skipping rows other replicas
-- hold locked, and grant it a new lease with the next epoch.
-- $1 machine_id, $2 vram_mb, $3 new lease_id, $4 lease ttl seconds, $5 sha256 of the lease's
-- secret (only the grant carries the secret itself), $6 quarantine threshold (node faults),
-- $7 quarantine window seconds, $8 empty leases (ended without a checkpoint) in that window
-- after which the machine gets nothing either; $9 the base model the worker says it holds
-- ('' none), $10 the step shapes it says it compiled, $11 the warm-dispatch bound in seconds,
-- $12 the adapter shapes it says it holds parked, $13 the model families it serves (a job of
-- another family is not offered to it).
--
-- Warm preference, among the first 64 claimable jobs in strict queue order (an index walk
-- however long the queue) and within that order's classes (re-queued jobs first, then
-- priority): a job whose compiled shape the worker holds, else whose adapter shape it holds
-- parked, else whose base model it holds, else the oldest. Fairness bound: a job queued for $11 s or longer (jobs.queued_at: since submit, or
-- since it was last re-queued) is overdue and goes before every job of its class that is not,
-- oldest first, whatever the worker holds: it waits at most $11 s longer than strict order would
-- have made it wait. What a worker says it holds is unverified, so it counts only where the
-- scheduler itself handed this machine a job with that key (`granted_keys`: its last 16
-- leases, from the ledger): an honest worker holds nothing warm that it was not granted, and a
-- worker cannot name another tenant's model to be handed that tenant's jobs. What is left to it
-- is to say it no longer holds something (it gets the oldest job instead).
WITH granted_keys AS (
    SELECT gj.resident_key, gj.compiled_shape_key, gj.adapter_shape_key
    FROM (SELECT l.job_id FROM leases l WHERE l.machine_id = $1
          ORDER BY l.granted_at DESC LIMIT 16) gl
    JOIN jobs gj ON gj.job_id = gl.job_id
), head AS (
    SELECT j.job_id FROM jobs j
    WHERE j.state = 'QUEUED'
      -- The job's memory need (the spec's or the family's estimate) fits the node's memory.
      AND j.min_vram_mb <= $2
      AND j.family = ANY ($13::text[])
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = j.job_id AND b.machine_id = $1)
      -- One live lease per machine: a machine that still holds one (its stream reconnected
      -- without resuming it) gets no second until that one ends or expires.
      AND NOT EXISTS (SELECT 1 FROM jobs r WHERE r.machine_id = $1 AND r.state = 'RUNNING'
                      AND r.lease_expires_at > now())
      -- Of any kind: a live sample task counts too.
      AND NOT EXISTS (SELECT 1 FROM sample_tasks r WHERE r.machine_id = $1
                      AND r.state = 'RUNNING' AND r.lease_expires_at > now())
      -- Quarantine: a machine with $6 node faults (or $8 empty leases) in the last $7 s gets
      -- nothing until the window passes (or the scaler replaces it: a new machine id starts
      -- clean), so a bad node costs at most $6 failed attempts, not one per queued job.
      AND NOT lorafleet_quarantined($1, $6::int, $7::float8, $8::int)
    ORDER BY (j.epoch > 0) DESC, j.priority DESC, j.created_at, j.job_id
    LIMIT 64
), candidate AS (
    -- Rows another replica is claiming are skipped; the state is checked again on the row
    -- locked (it may have been granted since `head` read it).
    SELECT j.job_id FROM jobs j JOIN head h ON h.job_id = j.job_id
    WHERE j.state = 'QUEUED'
    ORDER BY (j.epoch > 0) DESC, j.priority DESC,
             CASE WHEN j.queued_at <= now() - make_interval(secs => $11::float8) THEN 0
                  WHEN j.compiled_shape_key = ANY ($10::text[]) AND j.compiled_shape_key IN
                       (SELECT g.compiled_shape_key FROM granted_keys g) THEN 1
                  WHEN j.adapter_shape_key = ANY ($12::text[]) AND j.adapter_shape_key IN
                       (SELECT g.adapter_shape_key FROM granted_keys g) THEN 2
                  WHEN j.resident_key = $9 AND j.resident_key IN
                       (SELECT g.resident_key FROM granted_keys g) THEN 3
                  ELSE 4 END,
             j.created_at, j.job_id
    LIMIT 1
    FOR UPDATE OF j SKIP LOCKED
), granted AS (
    UPDATE jobs j
    SET state = 'RUNNING', epoch = j.epoch + 1, lease_id = $3, machine_id = $1,
        lease_expires_at = now() + make_interval(secs => $4), lease_progress_at = now(),
        lease_checkpoint_steps = NULL, lease_progress_step = NULL, updated_at = now()
    FROM candidate c WHERE j.job_id = c.job_id
    RETURNING j.*
), leased AS (
    -- granted_at is the clock when the row was locked, not now() (the statement's start): a
    -- statement that starts first can still grant a job a later transaction re-queued, and the
    -- ledger must show the previous lease ending before this one began.
    INSERT INTO leases (lease_id, job_id, epoch, machine_id, secret_sha256, granted_at,
                        last_heartbeat_at)
    SELECT lease_id, job_id, epoch, machine_id, $5, clock_timestamp(), clock_timestamp()
    FROM granted
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step)
    -- The step the lease starts from: its newest checkpoint (0 when fresh), not the last
    -- heartbeat of the previous holder, whose work after that checkpoint is lost.
    SELECT job_id, 'LEASE_GRANTED', 'RUNNING', lease_id, machine_id, epoch,
           coalesce(checkpoint_step, 0)
    FROM granted
)
SELECT * FROM granted;

-- name: resume_lease
-- A worker reconnected holding ($1 lease, $2 epoch) on machine $3 and presenting the lease's
-- secret (its sha256 is $5): keep the lease if it is still live and the secret matches, for
-- $4 s more. lease_traceparent: its grant span's (the job's, for a lease granted before
-- set_lease_traceparent was).
WITH resumed AS (
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => $4), updated_at = now()
    WHERE lease_id = $1 AND epoch = $2 AND machine_id = $3 AND state = 'RUNNING'
      AND (lease_expires_at > now()
          -- or it lapsed while no replica reached the ledger (an outage of the ledger or
          -- of every replica): its holder is back before a replica has said so
          -- (attend_replica), and the lapse was not its own.
          OR lease_expires_at > (SELECT max(last_seen_at) FROM scheduler_replicas))
      AND EXISTS (SELECT 1 FROM leases l WHERE l.lease_id = $1 AND l.secret_sha256 = $5)
    RETURNING *
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step)
    SELECT job_id, 'LEASE_RESUMED', state, lease_id, machine_id, epoch, progress_step FROM resumed
)
SELECT r.*, coalesce(l.traceparent, r.traceparent) AS lease_traceparent
FROM resumed r JOIN leases l USING (lease_id);

-- name: heartbeat
-- $1 lease, $2 epoch, $3 ttl s, $4 step, $5 loss, $6 lr, $7 s/step. Extends the lease.
-- $8: whether this one goes on the timeline (the session rate-limits HEARTBEAT events).
-- $9: whether the holder says its step runs compiled (NULL: it does not say).
WITH live AS (
    UPDATE jobs
    SET lease_expires_at = now() + make_interval(secs => $3),
        progress_step = $4, progress_loss = $5, progress_lr = $6, progress_s_per_step = $7,
        progress_machine_id = machine_id, progress_at = now(), updated_at = now()
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
      AND (lease_expires_at > now()
          -- or it lapsed while no replica reached the ledger (an outage of the ledger or
          -- of every replica): its holder is back before a replica has said so
          -- (attend_replica), and the lapse was not its own.
          OR lease_expires_at > (SELECT max(last_seen_at) FROM scheduler_replicas))
    RETURNING job_id, machine_id, lease_id, epoch
), touched AS (
    -- The holder's pace, for the scaler (0007): latest s/step, first and last step reported.
    UPDATE leases
    SET last_heartbeat_at = now(), seconds_per_step = coalesce($7, seconds_per_step),
        first_step = coalesce(first_step, $4), last_step = $4,
        step_compiled = coalesce($9, step_compiled)
    WHERE lease_id = (SELECT lease_id FROM live)
), logged AS (
    INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step, loss, seconds_per_step)
    SELECT job_id, 'HEARTBEAT', lease_id, machine_id, epoch, $4, $5, $7 FROM live WHERE $8
)
SELECT job_id FROM live;

-- name: record_canceled_progress
-- The step the holder of a lease revoked for a cancel says it reached (issue 32): the canceled
-- job shows it instead of its last heartbeat's. Only for the lease the cancel ended, from the
-- machine that held it, and only forward. $1 lease, $2 epoch, $3 machine, $4 step, $5 loss,
-- $6 lr, $7 s/step.
UPDATE jobs j
SET progress_step = $4, progress_loss = $5, progress_lr = $6,
    progress_s_per_step = coalesce($7, j.progress_s_per_step),
    progress_machine_id = $3, progress_at = now(), updated_at = now()
FROM leases l
WHERE l.lease_id = $1 AND l.epoch = $2 AND l.machine_id = $3 AND l.end_reason = 'canceled'
  AND j.job_id = l.job_id AND j.state = 'CANCELED'
  AND $4 >= coalesce(j.progress_step, 0)
RETURNING j.job_id;

-- name: expire_leases
-- The sweeper, safe on every replica: rows another replica is expiring are skipped. The
-- LEASE_EXPIRED event carries the last step the holder reported (the lease row's, which every
-- heartbeat moves, where the timeline keeps only some heartbeats) and says how many steps past
-- the job's newest checkpoint, where the next lease resumes, are lost: at least those, as the
-- holder may have trained on unheard (issue 31).
WITH expired AS (
    SELECT job_id, lease_id, machine_id, epoch, coalesce(checkpoint_step, 0) AS resume_step
    FROM jobs
    WHERE state = 'RUNNING' AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE jobs j
    SET state = 'QUEUED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        updated_at = now()
    FROM expired e WHERE j.job_id = e.job_id
    RETURNING j.job_id
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'expired'
    FROM expired e WHERE l.lease_id = e.lease_id
    RETURNING l.lease_id, l.last_step
), reported AS (
    SELECT e.*, d.last_step,
           greatest(coalesce(d.last_step, 0) - e.resume_step, 0) AS steps_lost
    FROM expired e LEFT JOIN ended d ON d.lease_id = e.lease_id
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step, message)
    SELECT job_id, 'LEASE_EXPIRED', 'QUEUED', lease_id, machine_id, epoch, last_step,
           CASE WHEN last_step IS NULL THEN 'no step reported; resumes from step ' || resume_step
                ELSE 'last reported step ' || last_step || '; resumes from step ' || resume_step
                     || ': at least ' || steps_lost || ' steps lost' END
    FROM reported
)
SELECT job_id, lease_id, machine_id, epoch, last_step, resume_step, steps_lost FROM reported;

-- name: stall_leases
-- The sweeper, beside expire_leases: a lease that made no verified progress (see
-- jobs.lease_progress_at: its grant, then checkpoints crossing an interval) for its bound ends
-- as a node fault: the machine is banned from the job, the fault counts toward its quarantine
-- and the job's node_faults (not its max_failures: fail_attempt), and the job is re-queued from
-- its newest checkpoint. Heartbeats
-- keep a lease from expiring but are no progress. The bound is $1 seconds for a job that
-- checkpoints every lorafleet_reference_interval() (100) steps, scaled by its interval (never
-- below $1), plus $1 per 100 class images it may have to generate first; the holder's stream
-- is revoked by the NOTIFY.
WITH stalled AS (
    SELECT job_id, lease_id, machine_id, epoch, node_faults, max_node_faults,
           round(extract(epoch FROM now() - lease_progress_at))::bigint AS silent_s
    FROM jobs
    WHERE state = 'RUNNING'
      AND lease_progress_at < now() - make_interval(secs => $1 * (
            greatest(1.0, least(lorafleet_lease_interval(spec, lease_checkpoint_steps),
                                 max_train_steps)
                            / lorafleet_reference_interval()::float8)
            + CASE WHEN (spec ->> 'with_prior_preservation')::boolean
                   THEN (spec ->> 'num_class_images')::int / 100.0 ELSE 0 END))
    ORDER BY lease_progress_at
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
), decided AS (
    SELECT s.*, CASE WHEN s.node_faults + 1 >= s.max_node_faults THEN 'FAILED' ELSE 'QUEUED'
                END AS new_state,
           'no verified progress (a checkpoint the store verified) for ' || s.silent_s
               || ' s; the lease was revoked as a node fault' AS message
    FROM stalled s
), updated AS (
    UPDATE jobs j
    SET state = d.new_state, node_faults = d.node_faults + 1,
        lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        error = CASE WHEN d.new_state = 'FAILED' THEN d.message ELSE j.error END,
        failure_class = CASE WHEN d.new_state = 'FAILED' THEN 'NODE' ELSE j.failure_class END,
        finished_at = CASE WHEN d.new_state = 'FAILED' THEN now() END,
        updated_at = now()
    FROM decided d WHERE j.job_id = d.job_id
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'failed: node'
    FROM decided d WHERE l.lease_id = d.lease_id
), banned AS (
    INSERT INTO bans (job_id, machine_id, reason)
    SELECT job_id, machine_id, message FROM decided
    ON CONFLICT DO NOTHING
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, message, failure_class)
    SELECT job_id, 'ATTEMPT_FAILED', new_state, lease_id, machine_id, epoch, message, 'NODE'
    FROM decided
    UNION ALL
    SELECT job_id, 'FAILED', 'FAILED', lease_id, machine_id, epoch, message, 'NODE'
    FROM decided WHERE new_state = 'FAILED'
)
SELECT job_id, lease_id, machine_id, epoch, new_state, silent_s FROM decided;

-- name: drain_lease
-- The holder is stopping ($1 lease, $2 epoch, $3 reason): re-queue at once, no failure counted.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
    FOR UPDATE
), requeued AS (
    UPDATE jobs j
    SET state = 'QUEUED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        updated_at = now()
    FROM target t WHERE j.job_id = t.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'drained'
    FROM target t WHERE l.lease_id = t.lease_id
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, message)
    SELECT job_id, 'DRAINED', 'QUEUED', lease_id, machine_id, epoch, $3 FROM target
)
SELECT * FROM requeued;

-- name: fail_attempt
-- $1 lease, $2 epoch, $3 class (NODE | INPUT | INTERNAL), $4 message, $5 the identity providers
-- whose machines the operator runs (lorafleet up's local supervisor, EC2 in its own account),
-- $6 the fleet's largest node memory in MB (0: unknown), $7 standing_min_age_s.
-- Every class bans the machine: a job is never leased again to a machine it failed on, so one
-- machine can spend at most one attempt of a job. A job's failure budget is the job's:
-- `failures` (against max_failures) counts only what the job can be blamed for, INTERNAL
-- errors from distinct machines the operator runs (lorafleet_operator_run: provider-verified by
-- a provider in $5) or in good standing for this job (lorafleet_good_standing:
-- provider-verified, a verified result of its own $7 seconds before the job was submitted and
-- no node fault since, most of its last attempts succeeded: a group of fresh machines cannot
-- earn it quickly), recounted at every failure, so that attempts on a machine gone bad since
-- count for nothing. INPUT counts none. It fails the job at once when the machine is one of
-- the operator's own: waiting for a second machine
-- there only re-queues a job that cannot succeed and makes the scaler fetch a node for it.
-- From any other machine it fails the job only when this machine and another that reported an
-- input fault on it are both in good standing for the job: those are strangers' machines, and
-- neither one of them alone nor a group of fresh ones may fail every job it is handed by
-- calling its inputs bad (docs/THREAT_MODEL.md). Every other attempt (NODE, INTERNAL from a
-- machine not in good standing, an unconfirmed INPUT) counts in `node_faults` and fails the
-- job only at max_node_faults: a few broken or hostile machines cannot fail a job an honest
-- node runs. A failure the fleet believed (INTERNAL counted in `failures`, a confirmed INPUT)
-- marks the lease `fault_believed`: not an empty lease toward the machine's quarantine.
-- An INTERNAL error on a node smaller than the fleet's largest class ($6 MiB,
-- fleet_max_vram_mb; 0: none) is taken for what the worker classes as INTERNAL, an
-- out-of-memory: the scheduler's mistake (the job's need was underestimated), not the node's
-- nor the job's. The job's memory need is raised above that node's memory (it goes to larger
-- nodes only); it counts nothing, bans no one, and the lease ends 'outgrown' (no empty lease
-- toward quarantine). Each raise passes one more node size, so there are few; on the largest
-- class it is an INTERNAL error like any other. A node within 10% of $6 is of the largest
-- class: cards report less than their nominal size (torch sees a 24 GB RTX 4090 as 24564 MiB),
-- and a raise past them (by an honest out-of-memory, or a machine announcing 24575 MiB) would
-- leave the job needing more than any real node of that class: QUEUED for ever. A raise thus
-- stops at 90% of $6.
WITH target AS (
    SELECT j.job_id, j.lease_id, j.machine_id, j.epoch, j.failures, j.max_failures,
           j.node_faults, j.max_node_faults, j.created_at AS submitted_at,
           coalesce($3 = 'INTERNAL'
                    AND (SELECT m.vram_mb FROM machines m WHERE m.machine_id = j.machine_id)
                        < 0.9 * $6::bigint, false) AS outgrown,
           (SELECT m.vram_mb FROM machines m WHERE m.machine_id = j.machine_id) AS node_vram_mb
    FROM jobs j
    WHERE j.lease_id = $1 AND j.epoch = $2 AND j.state = 'RUNNING'
      AND j.lease_expires_at > now()
    FOR UPDATE OF j
), judged AS (
    SELECT t.*,
           $3 = 'INTERNAL' AND NOT t.outgrown
               AND (lorafleet_operator_run(t.machine_id, $5::text[])
                    OR lorafleet_good_standing(t.machine_id, t.submitted_at, $7)) AS blamed,
           $3 = 'INPUT' AND ((
                   lorafleet_good_standing(t.machine_id, t.submitted_at, $7)
                   AND EXISTS (
                       SELECT 1 FROM job_events e
                       WHERE e.job_id = t.job_id AND e.kind = 'ATTEMPT_FAILED'
                         AND e.failure_class = 'INPUT' AND e.machine_id <> t.machine_id
                         AND lorafleet_good_standing(e.machine_id, t.submitted_at, $7)))
               OR lorafleet_operator_run(t.machine_id, $5::text[])) AS confirmed,
           (SELECT count(DISTINCT l.machine_id) FROM leases l
            WHERE l.job_id = t.job_id AND l.end_reason = 'failed: internal'
              AND l.machine_id <> t.machine_id
              AND (lorafleet_operator_run(l.machine_id, $5::text[])
                   OR lorafleet_good_standing(l.machine_id, t.submitted_at, $7))) AS blamed_before
    FROM target t
), decided AS (
    SELECT j.*,
           (j.blamed_before + CASE WHEN j.blamed THEN 1 ELSE 0 END)::int AS new_failures,
           j.node_faults + CASE WHEN j.blamed OR j.confirmed OR j.outgrown THEN 0 ELSE 1 END
               AS new_node_faults,
           CASE WHEN j.confirmed THEN 'FAILED'
                WHEN j.outgrown THEN 'QUEUED'
                WHEN j.blamed AND j.blamed_before + 1 >= j.max_failures THEN 'FAILED'
                WHEN NOT j.blamed AND j.node_faults + 1 >= j.max_node_faults THEN 'FAILED'
                ELSE 'QUEUED' END AS new_state,
           CASE WHEN NOT j.blamed AND NOT j.confirmed
                     AND j.node_faults + 1 >= j.max_node_faults
                THEN $4 || ' (' || (j.node_faults + 1) || ' attempts failed without the job'
                     || ' being to blame; the bound is ' || j.max_node_faults || ')'
                ELSE $4 END AS final_error
    FROM judged j
), updated AS (
    UPDATE jobs j
    SET state = d.new_state, failures = d.new_failures, node_faults = d.new_node_faults,
        min_vram_mb = CASE WHEN d.outgrown THEN greatest(j.min_vram_mb, d.node_vram_mb + 1)
                           ELSE j.min_vram_mb END,
        lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        error = CASE WHEN d.new_state = 'FAILED' THEN d.final_error ELSE j.error END,
        failure_class = CASE WHEN d.new_state = 'FAILED' THEN $3 ELSE j.failure_class END,
        finished_at = CASE WHEN d.new_state = 'FAILED' THEN now() END,
        updated_at = now()
    FROM decided d WHERE j.job_id = d.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(),
                        end_reason = CASE WHEN d.outgrown THEN 'outgrown'
                                          ELSE 'failed: ' || lower($3) END,
                        fault_believed = d.blamed OR d.confirmed
    FROM decided d WHERE l.lease_id = d.lease_id
), banned AS (
    INSERT INTO bans (job_id, machine_id, reason)
    SELECT job_id, machine_id, $4 FROM target WHERE NOT outgrown
    ON CONFLICT DO NOTHING
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, message, failure_class)
    SELECT job_id, 'ATTEMPT_FAILED', new_state, lease_id, machine_id, epoch,
           CASE WHEN outgrown THEN $4 || ' (the job now needs more than this node''s '
                                   || node_vram_mb || ' MiB: it goes to larger nodes only)'
                ELSE $4 END,
           $3
    FROM decided
    UNION ALL
    SELECT job_id, 'FAILED', 'FAILED', lease_id, machine_id, epoch, final_error, $3 FROM decided
    WHERE new_state = 'FAILED'
)
SELECT * FROM updated;

-- name: set_lease_traceparent
-- $1 lease, $2 epoch, $3 the W3C traceparent of its grant span (resume_lease returns it).
UPDATE leases SET traceparent = $3 WHERE lease_id = $1 AND epoch = $2;

-- name: set_lease_interval
-- $1 lease, $2 epoch, $3 the checkpoint interval the scheduler chose for that live lease, $4
-- what it was chosen from: a NOTICE on the job's timeline, in the same round trip.
WITH live AS (
    UPDATE jobs SET lease_checkpoint_steps = $3
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
    RETURNING job_id, lease_id, machine_id, epoch, progress_step
), logged AS (
    INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step, message)
    SELECT job_id, 'NOTICE', lease_id, machine_id, epoch, progress_step, $4 FROM live
)
SELECT job_id FROM live;

-- name: commit_checkpoint
-- $1 lease, $2 epoch, $3 step, $4 key, $5 bytes, $6 sha256. Recorded only under the live lease.
WITH live AS (
    SELECT job_id, lease_id, machine_id, epoch, coalesce(checkpoint_step, -1) <= $3 AS forward
    FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
    FOR UPDATE
), recorded AS (
    INSERT INTO checkpoints (job_id, step, epoch, key, size_bytes, sha256)
    SELECT job_id, $3, epoch, $4, $5, $6 FROM live
    ON CONFLICT (job_id, step, epoch) DO NOTHING
    RETURNING job_id
), newest AS (
    -- The job's newest checkpoint moves only forward. Verified progress for the stall bound
    -- (stall_leases) is the lease's own: its first checkpoint, then each past the next
    -- multiple of the lease's interval beyond the highest step it committed, so announcing
    -- step after step one apart stretches a lease no further than honest checkpoints would,
    -- and a bogus high step an earlier holder left does not starve an honest one of progress.
    UPDATE jobs j
    SET checkpoint_step = CASE WHEN l.forward THEN $3 ELSE j.checkpoint_step END,
        checkpoint_epoch = CASE WHEN l.forward THEN l.epoch ELSE j.checkpoint_epoch END,
        checkpoint_key = CASE WHEN l.forward THEN $4 ELSE j.checkpoint_key END,
        checkpoint_bytes = CASE WHEN l.forward THEN $5 ELSE j.checkpoint_bytes END,
        checkpoint_sha256 = CASE WHEN l.forward THEN $6 ELSE j.checkpoint_sha256 END,
        checkpoint_at = CASE WHEN l.forward THEN now() ELSE j.checkpoint_at END,
        -- A checkpoint of step N says its holder reached N: a drain's checkpoint, taken after
        -- the last heartbeat, is otherwise never shown (a job drained at 240 showed 191).
        progress_step = greatest(j.progress_step, $3),
        updated_at = now(),
        lease_progress_at = CASE
            WHEN j.lease_progress_step IS NULL
                 OR $3 / lorafleet_lease_interval(j.spec, j.lease_checkpoint_steps)
                    > j.lease_progress_step
                      / lorafleet_lease_interval(j.spec, j.lease_checkpoint_steps)
            THEN now() ELSE j.lease_progress_at END,
        lease_progress_step = greatest(coalesce(j.lease_progress_step, -1), $3)
    FROM live l WHERE j.job_id = l.job_id
), logged AS (
    INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step,
                            checkpoint_key, checkpoint_bytes, checkpoint_sha256)
    SELECT job_id, 'CHECKPOINT_COMMITTED', lease_id, machine_id, epoch, $3, $4, $5, $6 FROM live
), sampled AS (
    -- Validation images of this step: a sample task, when the spec asks for them (a prompt)
    -- and this is the first checkpoint at or after a multiple k * validation_steps, i.e. no
    -- step of [k * V, (k + 1) * V) has one yet: with an interval that divides V, the multiples
    -- themselves; with `checkpointing_steps: auto`, whose interval the node's pace picks,
    -- still one per V steps. Never twice a step.
    INSERT INTO sample_tasks (job_id, step, weights_key, weights_sha256, weights_is_checkpoint,
                              settings, max_failures)
    SELECT j.job_id, $3, $4, $6, true, lorafleet_sample_settings(j.spec), j.max_failures
    FROM jobs j JOIN recorded r USING (job_id)
    CROSS JOIN LATERAL (SELECT coalesce((j.spec ->> 'validation_steps')::int, 0) AS every) v
    WHERE jsonb_array_length(lorafleet_sample_settings(j.spec) -> 'prompts') > 0
      AND v.every > 0 AND $3 >= v.every
      AND NOT EXISTS (SELECT 1 FROM sample_tasks s
                      WHERE s.job_id = j.job_id
                        AND (s.step = $3 OR s.step / v.every = $3 / v.every))
)
SELECT job_id FROM live;

-- name: commit_class_images
-- $1 lease, $2 epoch; $3 indices, $4 keys, $5 bytes, $6 sha256s of generated class images the
-- store verified. Recorded only under the live lease, all or none; a repeat changes nothing.
WITH live AS (
    SELECT job_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
    FOR UPDATE
), recorded AS (
    INSERT INTO class_images (job_id, image_index, epoch, key, size_bytes, sha256)
    SELECT l.job_id, i.image_index, l.epoch, i.key, i.size_bytes, i.sha256
    FROM live l,
         unnest($3::integer[], $4::text[], $5::bigint[], $6::text[])
             AS i (image_index, key, size_bytes, sha256)
    ON CONFLICT (job_id, image_index, epoch) DO NOTHING
)
SELECT job_id FROM live;

-- name: recorded_class_images
-- $1 job, $2 epoch: the class images leases before epoch $2 recorded, the newest per index.
SELECT DISTINCT ON (image_index) * FROM class_images
WHERE job_id = $1 AND epoch < $2
ORDER BY image_index, epoch DESC;

-- name: succeed_job
-- $1 lease, $2 epoch, $3 result key, $4 bytes, $5 sha256, $6 step, $7 loss; $8, $9, $10 the kohya
-- file's key, bytes and sha256 beside it (output_format both), else NULL.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
    FOR UPDATE
), succeeded AS (
    UPDATE jobs j
    SET state = 'SUCCEEDED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        result_key = $3, result_bytes = $4, result_sha256 = $5,
        result_kohya_key = $8, result_kohya_bytes = $9, result_kohya_sha256 = $10,
        progress_step = $6, progress_loss = $7, progress_at = now(),
        progress_machine_id = t.machine_id,
        finished_at = now(), updated_at = now()
    FROM target t WHERE j.job_id = t.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'succeeded'
    FROM target t WHERE l.lease_id = t.lease_id
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step, loss)
    SELECT job_id, 'SUCCEEDED', 'SUCCEEDED', lease_id, machine_id, epoch, $6, $7 FROM target
), sampled AS (
    -- The result's validation images, unless a checkpoint of the same step has them.
    INSERT INTO sample_tasks (job_id, step, weights_key, weights_sha256, weights_is_checkpoint,
                              settings, max_failures)
    SELECT s.job_id, $6, $3, $5, false, lorafleet_sample_settings(s.spec), s.max_failures
    FROM succeeded s
    WHERE jsonb_array_length(lorafleet_sample_settings(s.spec) -> 'prompts') > 0
      AND NOT EXISTS (SELECT 1 FROM sample_tasks t WHERE t.job_id = s.job_id AND t.step = $6)
)
SELECT * FROM succeeded;

-- name: record_notice
-- The holder of live lease ($1, $2) reports a problem (message $3): it goes on the timeline.
INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step, message)
SELECT job_id, 'NOTICE', lease_id, machine_id, epoch, progress_step, $3 FROM jobs
WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now();

-- name: lease_is_live
-- Whether $1 is a job's (or a sample task's) live lease: a lease's upload URLs work only while
-- it is.
SELECT EXISTS (
    SELECT 1 FROM jobs WHERE lease_id = $1 AND state = 'RUNNING' AND lease_expires_at > now()
) OR EXISTS (
    SELECT 1 FROM sample_tasks
    WHERE lease_id = $1 AND state = 'RUNNING' AND lease_expires_at > now()
);

-- Checkpoint retention ---------------------------------------------------------------------------

-- name: live_checkpoints
-- Committed and still stored, newest first.
SELECT * FROM checkpoints WHERE job_id = $1 AND deleted_at IS NULL
ORDER BY step DESC, epoch DESC;

-- name: checkpoints_to_delete
-- Beyond the newest $2 of a running job, or every one once the job has finished; never one a
-- sample task still has to read.
SELECT c.job_id, c.step, c.epoch, c.key FROM checkpoints c JOIN jobs j USING (job_id)
WHERE c.deleted_at IS NULL AND c.job_id = $1
  AND NOT EXISTS (SELECT 1 FROM sample_tasks s WHERE s.job_id = c.job_id
                  AND s.weights_key = c.key AND s.state IN ('QUEUED', 'RUNNING'))
  AND (j.state IN ('SUCCEEDED', 'FAILED', 'CANCELED')
       OR (c.step, c.epoch) NOT IN (
           SELECT step, epoch FROM checkpoints
           WHERE job_id = $1 AND deleted_at IS NULL
           ORDER BY step DESC, epoch DESC LIMIT $2));

-- name: jobs_to_sweep
-- Finished jobs whose storage has not been swept since they finished, or not since the last
-- upload URL of their leases ($2 seconds after finishing) expired. $1: at most this many.
SELECT job_id, result_key, result_kohya_key FROM jobs
WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELED')
  -- Not while a sample task still reads one of its checkpoints.
  AND NOT EXISTS (SELECT 1 FROM sample_tasks s WHERE s.job_id = jobs.job_id
                  AND s.weights_is_checkpoint AND s.state IN ('QUEUED', 'RUNNING'))
  AND (storage_swept_at IS NULL
       OR (storage_swept_at < finished_at + make_interval(secs => $2)
           AND now() >= finished_at + make_interval(secs => $2)))
ORDER BY finished_at
LIMIT $1;

-- name: mark_storage_swept
UPDATE jobs SET storage_swept_at = now() WHERE job_id = $1;

-- name: finished_jobs_with_checkpoints
SELECT DISTINCT c.job_id FROM checkpoints c JOIN jobs j USING (job_id)
WHERE c.deleted_at IS NULL AND j.state IN ('SUCCEEDED', 'FAILED', 'CANCELED')
  AND NOT EXISTS (SELECT 1 FROM sample_tasks s WHERE s.job_id = c.job_id
                  AND s.weights_key = c.key AND s.state IN ('QUEUED', 'RUNNING'))
LIMIT $1;

-- name: mark_checkpoints_deleted
-- $1 job, $2 keys now gone from storage.
WITH marked AS (
    UPDATE checkpoints SET deleted_at = now()
    WHERE job_id = $1 AND key = ANY($2::text[]) AND deleted_at IS NULL
    RETURNING job_id, step, epoch, key
), forgotten AS (
    -- A job no longer shows a checkpoint that is gone (a finished job's, after cleanup).
    UPDATE jobs SET checkpoint_step = NULL, checkpoint_epoch = NULL, checkpoint_key = NULL,
        checkpoint_bytes = NULL, checkpoint_sha256 = NULL, checkpoint_at = NULL
    WHERE job_id = $1 AND checkpoint_key = ANY($2::text[])
)
INSERT INTO job_events (job_id, kind, epoch, step, checkpoint_key)
SELECT job_id, 'CHECKPOINT_DELETED', epoch, step, key FROM marked;

-- Machines and replicas --------------------------------------------------------------------------

-- name: upsert_machine
-- $1 machine id, $2 provider instance id, $3 GPU model, $4 GPU memory in MB, $5 qualified,
-- $6 the qualification's figures, $7 worker version, $8 the model families it serves.
INSERT INTO machines (machine_id, provider_instance_id, gpu_model, vram_mb, qualified,
                      qualification, version, families)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (machine_id) DO UPDATE
SET provider_instance_id = EXCLUDED.provider_instance_id, gpu_model = EXCLUDED.gpu_model,
    vram_mb = EXCLUDED.vram_mb, qualified = EXCLUDED.qualified,
    qualification = EXCLUDED.qualification, version = EXCLUDED.version,
    families = EXCLUDED.families, last_seen_at = now();

-- name: touch_machine
-- Only the stream holding the machine's session ($2, its token's sha256) keeps it alive.
UPDATE machines SET last_seen_at = now()
WHERE machine_id = $1 AND session_token_sha256 IS NOT DISTINCT FROM $2;

-- name: release_machine_session
-- Machine $1's stream (session token digest $2) drained and ended: its id is free at once.
UPDATE machines SET session_token_sha256 = NULL
WHERE machine_id = $1 AND session_token_sha256 = $2;

-- name: expire_machines
-- The node registry forgets machine ids that no provider vouched for and nothing names: never
-- verified (a verified row ranks its id above unverified claims, so it stays), silent for $1
-- seconds (at least a lease TTL: until then the id is its last stream's, see
-- claim_machine_session), and named by no lease (quarantine, statistics and billing read
-- those; every job a machine held or progressed has one), no ban and no unfinished sample
-- task. Deleting such a row loses nothing: a Hello under the id makes a new one. What is left
-- are a reconnect loop's made-up ids and honest machines that never got work. At most 1000
-- per call; safe on every replica.
WITH expired AS (
    SELECT m.machine_id FROM machines m
    WHERE m.identity_provider = '' AND m.last_seen_at < now() - make_interval(secs => $1)
      AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.machine_id = m.machine_id)
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.machine_id = m.machine_id)
      AND NOT EXISTS (SELECT 1 FROM sample_tasks s
                      WHERE s.state IN ('QUEUED', 'RUNNING')
                        AND (s.machine_id = m.machine_id OR m.machine_id = ANY (s.banned_machines)))
    ORDER BY m.last_seen_at
    LIMIT 1000
    FOR UPDATE OF m SKIP LOCKED
)
DELETE FROM machines m USING expired e
WHERE m.machine_id = e.machine_id
  -- Re-checked under the row lock: a Hello may have claimed the id since the scan.
  AND m.identity_provider = '' AND m.last_seen_at < now() - make_interval(secs => $1)
RETURNING m.machine_id;

-- name: claim_machine_session
-- A stream says Hello as machine $1: it gets the machine id (session token digest $3) if the
-- machine is new, if it presents the previous stream's token (digest $2), or if the machine
-- has been silent for $4 seconds. Nothing is written otherwise: one stream cannot end or take
-- over another's. Provider identities ($5: who vouched for this stream's id, '' for nobody)
-- rank above that: a verified stream takes an id from an unverified holder at once (a squatter
-- cannot keep the real machine out), and an unverified stream never takes a verified id.
INSERT INTO machines (machine_id, session_token_sha256, identity_provider, identity_verified_at)
VALUES ($1, $3, $5, CASE WHEN $5 <> '' THEN now() END)
ON CONFLICT (machine_id) DO UPDATE
SET session_token_sha256 = EXCLUDED.session_token_sha256, last_seen_at = now(),
    identity_provider = EXCLUDED.identity_provider,
    identity_verified_at = EXCLUDED.identity_verified_at
WHERE NOT (machines.identity_provider <> '' AND $5 = '')
  AND (machines.session_token_sha256 IS NULL
       OR machines.session_token_sha256 = $2
       OR machines.last_seen_at < now() - make_interval(secs => $4)
       OR ($5 <> '' AND machines.identity_provider = ''))
RETURNING machine_id;

-- name: start_replica
-- Replica $1 starts. If no replica said it was alive in the last $3 seconds (a few sweep
-- intervals), every replica was down: leases lapsed meanwhile through no fault of their
-- workers, so each running lease gets at least a TTL ($2 s) from now to reconnect in.
-- Returns how many leases were extended.
WITH outage AS (
    SELECT coalesce(max(last_seen_at), '-infinity') < now() - make_interval(secs => $3) AS down,
           now() - coalesce(max(last_seen_at), now()) AS gap
    FROM scheduler_replicas
), extended AS (
    -- No checkpoint could be recorded meanwhile either: the stall bound (stall_leases) does
    -- not count the outage.
    UPDATE jobs
    SET lease_expires_at = greatest(lease_expires_at, now() + make_interval(secs => $2)),
        lease_progress_at = lease_progress_at + (SELECT gap FROM outage),
        updated_at = now()
    WHERE state = 'RUNNING' AND (SELECT down FROM outage)
    RETURNING job_id
), kept AS (
    -- Machine ids too: their silence was ours, so none is up for grabs by a new stream before
    -- its own worker has had a TTL to come back with its session token.
    UPDATE machines SET last_seen_at = now()
    WHERE (SELECT down FROM outage) AND session_token_sha256 IS NOT NULL
), forgotten AS (
    DELETE FROM scheduler_replicas WHERE last_seen_at < now() - interval '1 day'
), registered AS (
    INSERT INTO scheduler_replicas (replica_id) VALUES ($1)
    ON CONFLICT (replica_id) DO UPDATE SET started_at = now(), last_seen_at = now()
)
SELECT count(*) FROM extended;

-- name: touch_replica
UPDATE scheduler_replicas SET last_seen_at = now() WHERE replica_id = $1;

-- name: attend_replica
-- Replica $1 reaches the ledger (every second or so, on every replica). A lease's TTL counts
-- only time in which some replica reached the ledger, on the ledger's clock: if no replica had
-- for $3 seconds (the ledger was unreachable, or every replica was down or frozen), every lease
-- that was live when the ledger last heard from one gets at least a TTL ($2 s) from now, so its
-- holder can reconnect and heartbeat; the stall bound does not count the silence either.
-- Sample tasks and held machine ids likewise. Returns how many job leases were extended.
WITH outage AS (
    SELECT coalesce(max(last_seen_at), now()) AS seen,
           coalesce(max(last_seen_at), now()) < now() - make_interval(secs => $3) AS down
    FROM scheduler_replicas
), extended AS (
    UPDATE jobs
    SET lease_expires_at = greatest(lease_expires_at, now() + make_interval(secs => $2)),
        lease_progress_at = lease_progress_at + (now() - (SELECT seen FROM outage)),
        updated_at = now()
    WHERE state = 'RUNNING' AND (SELECT down FROM outage)
      AND lease_expires_at > (SELECT seen FROM outage)
    RETURNING job_id
), tasks AS (
    UPDATE sample_tasks
    SET lease_expires_at = greatest(lease_expires_at, now() + make_interval(secs => $2))
    WHERE state = 'RUNNING' AND (SELECT down FROM outage)
      AND lease_expires_at > (SELECT seen FROM outage)
), kept AS (
    UPDATE machines SET last_seen_at = now()
    WHERE (SELECT down FROM outage) AND session_token_sha256 IS NOT NULL
      AND last_seen_at > (SELECT seen FROM outage) - make_interval(secs => $2)
), touched AS (
    INSERT INTO scheduler_replicas (replica_id) VALUES ($1)
    ON CONFLICT (replica_id) DO UPDATE SET last_seen_at = now()
)
SELECT count(*) FROM extended;

-- The timeline and counts ------------------------------------------------------------------------

-- name: list_events
SELECT * FROM job_events WHERE job_id = $1 AND event_id > $2 ORDER BY event_id LIMIT $3;

-- name: count_queued
SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'QUEUED' LIMIT $1) q;

-- name: count_jobs_by_state
-- Jobs per state for the metrics, each count capped at $1 (a scrape stays cheap however long
-- the ledger's history).
SELECT s.state, (SELECT count(*) FROM (SELECT 1 FROM jobs j WHERE j.state = s.state LIMIT $1) q)
FROM unnest(ARRAY['QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELED']) AS s(state);

-- name: job_leases
SELECT lease_id, job_id, epoch, machine_id, granted_at, last_heartbeat_at, ended_at, end_reason
FROM leases WHERE job_id = $1 ORDER BY epoch;

-- Webhook outbox ---------------------------------------------------------------------------------

-- name: claim_webhook_deliveries
-- Takes up to $1 due deliveries for $2 seconds (a crashed replica's claims come back after it).
WITH due AS (
    SELECT delivery_id FROM webhook_deliveries
    WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE webhook_deliveries d
SET attempts = d.attempts + 1, next_attempt_at = now() + make_interval(secs => $2)
FROM due, jobs j, api_keys k
WHERE d.delivery_id = due.delivery_id AND j.job_id = d.job_id AND k.key_id = j.api_key_id
RETURNING d.delivery_id, d.job_id, d.event, d.url, d.payload, d.attempts, k.webhook_secret;

-- name: webhook_delivered
UPDATE webhook_deliveries SET delivered_at = now(), last_status = $2, last_error = NULL
WHERE delivery_id = $1;

-- name: webhook_failed
-- $1 delivery, $2 status (NULL: no response), $3 error, $4 seconds until the next try, or
-- NULL to give up.
UPDATE webhook_deliveries
SET last_status = $2, last_error = $3,
    next_attempt_at = CASE WHEN $4::float8 IS NULL THEN next_attempt_at
                           ELSE now() + make_interval(secs => $4::float8) END,
    gave_up_at = CASE WHEN $4::float8 IS NULL THEN now() END
WHERE delivery_id = $1;

-- name: list_webhook_deliveries
SELECT delivery_id, event, url, attempts, last_status, last_error, delivered_at, gave_up_at,
       created_at, next_attempt_at
FROM webhook_deliveries WHERE job_id = $1 ORDER BY delivery_id;

-- name: next_webhook_due
-- Seconds until the next pending delivery is due (NULL: none pending).
SELECT extract(epoch FROM min(next_attempt_at) - now()) FROM webhook_deliveries
WHERE delivered_at IS NULL AND gave_up_at IS NULL;

-- The scaler -------------------------------------------------------------------------------------

-- What the scaler reads of the fleet and records of its decisions (docs/DESIGN.md, "The
-- scaler's view").

-- name: drop_lease
-- The scaler takes job $2 away from machine $1 (a slow node): the lease ends, the job is
-- re-queued from its newest checkpoint with no failure counted, and the machine is banned for
-- it ($3 the reason). The jobs trigger's NOTIFY has the replica holding the stream revoke it.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE job_id = $2 AND machine_id = $1 AND state = 'RUNNING'
    FOR UPDATE
), requeued AS (
    UPDATE jobs j
    SET state = 'QUEUED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        updated_at = now()
    FROM target t WHERE j.job_id = t.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'dropped'
    FROM target t WHERE l.lease_id = t.lease_id
), banned AS (
    INSERT INTO bans (job_id, machine_id, reason)
    SELECT job_id, machine_id, $3 FROM target
    ON CONFLICT DO NOTHING
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, message)
    SELECT job_id, 'DRAINED', 'QUEUED', lease_id, machine_id, epoch, $3 FROM target
)
SELECT * FROM requeued;

-- name: list_nodes
-- The node registry: machines ($1 these ids; NULL: every one, newest first, at most $3), each
-- with its live lease, its node faults (all counted; the times of those in the last $2 s),
-- and the jobs it finished. `qualified` is NULL until the worker's Hello was recorded.
WITH live AS (
    SELECT machine_id, job_id FROM jobs WHERE state = 'RUNNING'
)
SELECT m.machine_id, m.provider_instance_id, m.identity_provider, m.gpu_model, m.vram_mb,
       CASE WHEN m.qualification = '{}'::jsonb THEN NULL ELSE m.qualified END AS qualified,
       m.qualification ->> 'detail' AS qualification_detail, m.version,
       m.first_seen_at, m.last_seen_at,
       (SELECT lv.job_id FROM live lv WHERE lv.machine_id = m.machine_id LIMIT 1) AS lease_job_id,
       (SELECT count(*) FROM leases l
        WHERE l.machine_id = m.machine_id AND l.end_reason = 'failed: node') AS node_faults,
       ARRAY(SELECT extract(epoch FROM l.ended_at)::float8 FROM leases l
             WHERE l.machine_id = m.machine_id AND l.end_reason = 'failed: node'
               AND l.ended_at > now() - make_interval(secs => $2)
             ORDER BY l.ended_at DESC LIMIT 1000) AS recent_fault_times,
       (SELECT count(*) FROM leases l
        WHERE l.machine_id = m.machine_id AND l.end_reason = 'succeeded') AS jobs_finished
FROM machines m
WHERE $1::text[] IS NULL OR m.machine_id = ANY($1::text[])
ORDER BY m.last_seen_at DESC, m.machine_id
LIMIT $3;

-- name: pace_observations
-- What the scheduler itself saw of each lease granted in the last $1 s (newest first, at most
-- $2): the steps between the first and the last checkpoint the store verified under it, and
-- the ledger's clock between their commits (NULL with fewer than two); for a lease that ended
-- with a verified result, the steps it had to run (max_train_steps less the checkpoint it
-- resumed from) and the ledger's clock from grant to end; beside them what the holder said of
-- its own pace (believed only against itself), whether the lease is live, the job's shape (its
-- key, or the job's id for a job without one, and its spec), whether the holder said its step
-- ran compiled, the machine's GPU and who vouched for its id ('': nobody).
WITH recent AS (
    SELECT lease_id, job_id, epoch, machine_id, granted_at, ended_at, end_reason,
           seconds_per_step, first_step, last_step, step_compiled
    FROM leases
    WHERE granted_at > now() - make_interval(secs => $1)
    ORDER BY granted_at DESC
    LIMIT $2
), verified AS (
    -- First and last by commit time, so that steps announced out of order count for nothing.
    SELECT r.lease_id,
           (array_agg(c.step ORDER BY c.committed_at DESC, c.step DESC))[1]
               - (array_agg(c.step ORDER BY c.committed_at, c.step))[1] AS steps,
           extract(epoch FROM max(c.committed_at) - min(c.committed_at))::float8 AS seconds
    FROM recent r JOIN checkpoints c ON c.job_id = r.job_id AND c.epoch = r.epoch
    GROUP BY r.lease_id
    HAVING count(*) >= 2
)
SELECT r.machine_id, r.job_id, r.epoch, r.ended_at IS NULL AS live,
       CASE WHEN v.steps > 0 AND v.seconds > 0 THEN v.steps END AS observed_steps,
       CASE WHEN v.steps > 0 AND v.seconds > 0 THEN v.seconds END AS observed_seconds,
       CASE WHEN r.end_reason = 'succeeded' AND r.ended_at > r.granted_at
                 AND j.max_train_steps > coalesce(g.step, 0)
            THEN j.max_train_steps - coalesce(g.step, 0) END AS completed_steps,
       CASE WHEN r.end_reason = 'succeeded' AND r.ended_at > r.granted_at
                 AND j.max_train_steps > coalesce(g.step, 0)
            THEN extract(epoch FROM r.ended_at - r.granted_at)::float8 END AS completed_seconds,
       r.seconds_per_step::float8 AS reported_seconds_per_step,
       greatest(coalesce(r.last_step - r.first_step, 0), 0) AS reported_steps,
       coalesce(j.shape_key, j.job_id::text) AS shape_key, j.spec, r.step_compiled,
       coalesce(m.gpu_model, '') AS gpu_class,
       coalesce(m.identity_provider, '') AS identity_provider
FROM recent r
JOIN jobs j ON j.job_id = r.job_id
LEFT JOIN machines m ON m.machine_id = r.machine_id
LEFT JOIN verified v ON v.lease_id = r.lease_id
LEFT JOIN LATERAL (
    SELECT e.step FROM job_events e
    WHERE e.job_id = r.job_id AND e.lease_id = r.lease_id AND e.kind = 'LEASE_GRANTED'
    LIMIT 1
) g ON r.end_reason = 'succeeded';

-- name: pace_references
-- The scaler's learned reference pace per GPU class (scaler/policy.py, learn_references).
SELECT gpu_class, seconds_per_step, machines, extract(epoch FROM updated_at)::float8 AS updated_at
FROM pace_references ORDER BY gpu_class LIMIT 1000;

-- name: set_pace_reference
-- $1 GPU class, $2 seconds per 1024x1024 image step, $3 machines it rests on, $4 when (epoch s,
-- the scaler's clock: the rate bound counts hours on it).
INSERT INTO pace_references (gpu_class, seconds_per_step, machines, updated_at)
VALUES ($1, $2, $3, to_timestamp($4))
ON CONFLICT (gpu_class) DO UPDATE
SET seconds_per_step = excluded.seconds_per_step, machines = excluded.machines,
    updated_at = excluded.updated_at;

-- name: scaler_work
-- Queued and running work (jobs and sample tasks: a job's validation images need a node too),
-- and when the newest finished job finished (the idle grace starts then when nothing is queued
-- or running). Running work counts only leases held by a machine the provider lists now ($1)
-- or one a provider vouched for: a lease under a made-up machine id is on no instance of the
-- fleet, so it is neither demand nor a reason to keep a node (the stall bound gives its job
-- back); `unplaced` counts those left out.
WITH holders AS (
    SELECT machine_id FROM jobs WHERE state = 'RUNNING'
    UNION ALL
    SELECT machine_id FROM sample_tasks WHERE state = 'RUNNING'
), placed AS (
    SELECT h.machine_id = ANY ($1::text[])
           OR EXISTS (SELECT 1 FROM machines m
                      WHERE m.machine_id = h.machine_id AND m.identity_provider <> '') AS placed
    FROM holders h
)
SELECT (SELECT count(*) FROM jobs WHERE state = 'QUEUED')
       + (SELECT count(*) FROM sample_tasks WHERE state = 'QUEUED') AS queued,
       (SELECT count(*) FROM placed WHERE placed) AS running,
       (SELECT count(*) FROM placed WHERE NOT placed) AS unplaced,
       (SELECT max(finished_at) FROM jobs WHERE finished_at IS NOT NULL) AS last_finished_at;

-- name: banned_queued_jobs
-- Queued jobs that some machine is banned from, with those machines (at most $1 jobs).
SELECT j.job_id, array_agg(b.machine_id ORDER BY b.machine_id) AS banned_machines
FROM jobs j JOIN bans b ON b.job_id = j.job_id
WHERE j.state = 'QUEUED'
GROUP BY j.job_id
ORDER BY j.job_id
LIMIT $1;

-- name: record_scaler_decision
-- $1 at (epoch s, the scaler's clock), $2 scaler id, $3 action, $4 target, $5 job, $6 reason,
-- $7 figures, $8 fold key, $9 error, $10 the row to fold into (NULL: none). A HOLD folds into
-- row $10 only if that row is the target's newest, a HOLD of the same scaler with the same
-- fold key: the scaler names it only when it wrote it on its previous tick, so one row stands
-- for one run of identical consecutive decisions of one scaler, never for two incidents.
-- Returns the row's id and whether it was folded.
WITH newest AS (
    SELECT decision_id, action, fold_key, scaler_id FROM scaler_decisions
    WHERE target = $4 ORDER BY decision_id DESC LIMIT 1
), folded AS (
    UPDATE scaler_decisions d
    SET last_at = to_timestamp($1), repeats = d.repeats + 1, reason = $6, figures = $7,
        error = $9
    FROM newest n
    WHERE d.decision_id = n.decision_id AND n.decision_id = $10::bigint
      AND $3 = 'hold' AND n.action = 'hold' AND n.fold_key = $8 AND n.scaler_id = $2
    RETURNING d.decision_id
), inserted AS (
    INSERT INTO scaler_decisions (at, last_at, scaler_id, action, target, job_id, reason,
                                  figures, fold_key, error)
    SELECT to_timestamp($1), to_timestamp($1), $2, $3, $4, $5, $6, $7, $8, $9
    WHERE NOT EXISTS (SELECT 1 FROM folded)
    RETURNING decision_id
)
SELECT decision_id, true AS folded FROM folded
UNION ALL
SELECT decision_id, false AS folded FROM inserted;

-- name: finish_scaler_decision
-- $1 decision, $2 whether it was carried out, $3 the error if not, $4 when it took effect
-- (epoch s; NULL: keep the time it was decided). Cooldowns count from this time.
UPDATE scaler_decisions
SET applied = $2, error = $3,
    at = coalesce(to_timestamp($4::float8), at),
    last_at = greatest(last_at, coalesce(to_timestamp($4::float8), last_at))
WHERE decision_id = $1;

-- name: recent_scaler_actions
-- What the scaler carried out since $1 (epoch s): cooldowns, hold-offs and the reallocation
-- rate limit read it.
SELECT extract(epoch FROM at)::float8 AS at, action, target, job_id
FROM scaler_decisions
WHERE at >= to_timestamp($1) AND applied AND action <> 'hold'
ORDER BY decision_id;

-- name: list_scaler_decisions
-- The newest $1 decisions, newest first (`lorafleet scaler-log`).
SELECT decision_id, at, last_at, repeats, scaler_id, action, target, job_id, reason, figures,
       applied, error
FROM scaler_decisions ORDER BY decision_id DESC LIMIT $1;

-- Sample tasks -----------------------------------------------------------------------------------

-- Validation images on the fleet, leased like jobs.

-- name: claim_sample_task
-- Like claim_job, for a worker that found no training job: the oldest claimable task, re-runs
-- first. $1 machine_id, $2 vram_mb, $3 new lease_id, $4 lease ttl s, $5 sha256 of its secret,
-- $6, $7 and $8 the quarantine (as claim_job's), $9 the model families it serves (a task runs
-- its job's family's pipeline).
WITH candidate AS (
    SELECT s.task_id FROM sample_tasks s JOIN jobs j USING (job_id)
    WHERE s.state = 'QUEUED' AND j.min_vram_mb <= $2 AND NOT ($1 = ANY (s.banned_machines))
      AND j.family = ANY ($9::text[])
      -- One live lease of any kind per machine (as claim_job): one stream cannot hoard tasks,
      -- and a machine back without resuming its training lease gets no task meanwhile.
      AND NOT EXISTS (SELECT 1 FROM jobs r WHERE r.machine_id = $1 AND r.state = 'RUNNING'
                      AND r.lease_expires_at > now())
      AND NOT EXISTS (SELECT 1 FROM sample_tasks r WHERE r.machine_id = $1
                      AND r.state = 'RUNNING' AND r.lease_expires_at > now())
      AND NOT lorafleet_quarantined($1, $6::int, $7::float8, $8::int)
    ORDER BY (s.epoch > 0) DESC, j.priority DESC, s.created_at, s.task_id
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED
), granted AS (
    UPDATE sample_tasks s
    SET state = 'RUNNING', epoch = s.epoch + 1, lease_id = $3, machine_id = $1,
        lease_expires_at = now() + make_interval(secs => $4), secret_sha256 = $5,
        granted_at = now()
    FROM candidate c WHERE s.task_id = c.task_id
    RETURNING s.*
), logged AS (
    INSERT INTO job_events (job_id, kind, machine_id, step, message)
    SELECT job_id, 'SAMPLES_STARTED', machine_id, step,
           'sample task ' || task_id || ' attempt ' || epoch FROM granted
)
SELECT g.*, j.spec, j.owner, j.traceparent FROM granted g JOIN jobs j USING (job_id);

-- name: training_claimable
-- Whether machine $1 ($2 MB, serving the families $3) could claim a queued training job now:
-- then a sample task it holds gives way (training is never delayed by samples).
SELECT EXISTS (
    SELECT 1 FROM jobs j
    WHERE j.state = 'QUEUED' AND j.min_vram_mb <= $2 AND j.family = ANY ($3::text[])
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = j.job_id AND b.machine_id = $1)
);

-- name: heartbeat_sample_task
-- $1 lease, $2 epoch, $3 ttl s: extends the task's lease while it is live.
UPDATE sample_tasks SET lease_expires_at = now() + make_interval(secs => $3)
WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
RETURNING task_id;

-- name: complete_sample_task
-- $1 lease, $2 epoch, $3 the stored images (jsonb array). Fenced like every worker write.
WITH target AS (
    SELECT task_id FROM sample_tasks
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
    FOR UPDATE
), done AS (
    UPDATE sample_tasks s
    SET state = 'SUCCEEDED', lease_id = NULL, lease_expires_at = NULL, images = $3,
        finished_at = now(),
        busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
    FROM target t WHERE s.task_id = t.task_id
    RETURNING s.*
), logged AS (
    INSERT INTO job_events (job_id, kind, machine_id, step, message)
    SELECT job_id, 'SAMPLES', machine_id, step,
           jsonb_array_length($3) || ' validation images stored' FROM done
)
SELECT * FROM done;

-- name: fail_sample_task
-- $1 lease, $2 epoch, $3 class, $4 message, $5 the operator-run identity providers, $6
-- standing_min_age_s: as fail_attempt, for the task only (its job is never touched). NODE and
-- INTERNAL ban the machine from the task and count a failure. INPUT fails the task at once
-- when an operator-run machine or one in good standing for the job says it
-- (lorafleet_good_standing); from any other machine it is a failure like NODE: one stranger's
-- machine, or a fresh one, must not fail every task it is handed for good with one word.
WITH target AS (
    SELECT s.task_id, s.job_id, s.machine_id, s.step, s.failures, s.max_failures,
           $3 = 'INPUT' AND (
               EXISTS (SELECT 1 FROM machines m
                       WHERE m.machine_id = s.machine_id
                         AND m.identity_provider = ANY($5::text[]))
               OR lorafleet_good_standing(
                   s.machine_id, (SELECT j.created_at FROM jobs j WHERE j.job_id = s.job_id),
                   $6)) AS believed
    FROM sample_tasks s
    WHERE s.lease_id = $1 AND s.epoch = $2 AND s.state = 'RUNNING'
      AND s.lease_expires_at > now()
    FOR UPDATE OF s
), decided AS (
    SELECT t.*,
           t.failures + CASE WHEN t.believed THEN 0 ELSE 1 END AS new_failures,
           CASE WHEN t.believed OR t.failures + 1 >= t.max_failures THEN 'FAILED'
                ELSE 'QUEUED' END AS new_state
    FROM target t
), updated AS (
    UPDATE sample_tasks s
    SET state = d.new_state, failures = d.new_failures, lease_id = NULL,
        lease_expires_at = NULL, error = $4,
        banned_machines = CASE WHEN NOT d.believed
                               THEN array_append(s.banned_machines, d.machine_id)
                               ELSE s.banned_machines END,
        finished_at = CASE WHEN d.new_state = 'FAILED' THEN now() END,
        busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
    FROM decided d WHERE s.task_id = d.task_id
    RETURNING s.*
), logged AS (
    INSERT INTO job_events (job_id, kind, machine_id, step, message, failure_class)
    SELECT job_id, 'SAMPLES_FAILED', machine_id, step, $4, $3 FROM decided
    WHERE new_state = 'FAILED'
)
SELECT * FROM updated;

-- name: drain_sample_task
-- The holder stops ($1 lease, $2 epoch): drained, or giving way to training. Re-queued at
-- once, no failure counted.
UPDATE sample_tasks s
SET state = 'QUEUED', lease_id = NULL, lease_expires_at = NULL,
    busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING' AND lease_expires_at > now()
RETURNING task_id;

-- name: abandon_sample_task
-- Machine $3 said Ready while holding task ($1 lease, $2 epoch): the task goes back to the
-- queue at once, no failure counted, and the machine is banned from it (as drop_lease for a
-- training lease), so one stream can neither hoard tasks nor collect one's URLs twice.
UPDATE sample_tasks s
SET state = 'QUEUED', lease_id = NULL, lease_expires_at = NULL,
    banned_machines = CASE WHEN $3 = ANY (s.banned_machines) THEN s.banned_machines
                           ELSE array_append(s.banned_machines, $3::text) END,
    busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
WHERE lease_id = $1 AND epoch = $2 AND machine_id = $3 AND state = 'RUNNING'
  AND lease_expires_at > now()
RETURNING task_id;

-- name: release_machine_sample_tasks
-- A new stream of machine $1 holds its id: a sample task is never resumed, so what the
-- machine still held goes back to the queue at once (no failure, no ban), and neither the task
-- nor the worker waits out the old lease.
UPDATE sample_tasks s
SET state = 'QUEUED', lease_id = NULL, lease_expires_at = NULL,
    busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
WHERE s.machine_id = $1 AND s.state = 'RUNNING'
RETURNING task_id;

-- name: expire_sample_tasks
-- The sweeper: a task whose lease lapsed goes back to the queue (no failure counted).
WITH expired AS (
    SELECT task_id FROM sample_tasks
    WHERE state = 'RUNNING' AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT 1000
    FOR UPDATE SKIP LOCKED
)
UPDATE sample_tasks s
SET state = 'QUEUED', lease_id = NULL, lease_expires_at = NULL,
    busy_seconds = s.busy_seconds + extract(epoch FROM now() - s.granted_at)
FROM expired e WHERE s.task_id = e.task_id
RETURNING s.task_id, s.job_id, s.machine_id, s.epoch;

-- name: samples_pending
-- Whether a sample task of job $1 is still to run (WatchJob stays open until none is).
SELECT EXISTS (
    SELECT 1 FROM sample_tasks WHERE job_id = $1 AND state IN ('QUEUED', 'RUNNING')
);

-- name: sample_tasks_of_job
-- A job's sample tasks, by step.
SELECT * FROM sample_tasks WHERE job_id = $1 ORDER BY step, created_at, task_id;

-- name: request_samples
-- Sample tasks on request for job $1 of owner $2 at steps $3 (the result's step, or a kept
-- checkpoint's) with settings $4 (jsonb). Returns the steps queued: all of them, or none.
WITH job AS (
    SELECT * FROM jobs WHERE job_id = $1 AND owner = $2
), weights AS (
    SELECT DISTINCT ON (w.step) w.* FROM (
        SELECT j.progress_step AS step, j.result_key AS key, j.result_sha256 AS sha256,
               false AS is_checkpoint, 0 AS rank
        FROM job j WHERE j.result_key IS NOT NULL
        UNION ALL
        SELECT c.step, c.key, c.sha256, true, 1 FROM checkpoints c JOIN job j USING (job_id)
        WHERE c.deleted_at IS NULL
    ) w
    WHERE w.step = ANY ($3::bigint[])
    ORDER BY w.step, w.rank
)
INSERT INTO sample_tasks (job_id, step, weights_key, weights_sha256, weights_is_checkpoint,
                          settings, max_failures)
SELECT j.job_id, w.step, w.key, w.sha256, w.is_checkpoint, $4, j.max_failures
FROM job j, weights w
-- All or nothing: every step asked for has its weights.
WHERE (SELECT count(*) FROM weights) = (SELECT count(DISTINCT x) FROM unnest($3::bigint[]) x)
RETURNING step;
