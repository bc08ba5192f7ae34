-- Every query the scheduler runs. Sections start with `-- name: <method>`; the Ledger class has
-- one method per section. Worker-facing writes are fenced: they only touch the job while
-- (lease_id, epoch) is still its live lease.

-- name: insert_api_key
INSERT INTO api_keys (key_id, owner, secret_sha256, webhook_url, webhook_events)
VALUES ($1, $2, $3, $4, $5)
RETURNING webhook_secret;

-- name: get_api_key
SELECT key_id, owner, secret_sha256 FROM api_keys WHERE key_id = $1 AND revoked_at IS NULL;

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now() WHERE key_id = $1 AND revoked_at IS NULL RETURNING key_id;

-- name: list_api_keys
SELECT key_id, owner, created_at, revoked_at, webhook_url FROM api_keys ORDER BY created_at, key_id;

-- name: insert_jobs
-- $1 owner; then one array per column, one element per job; $11 the submitting API key. Rows whose idempotency key the owner
-- already used are skipped here and read back by get_jobs_by_idempotency_key.
WITH input AS (
    SELECT * FROM unnest($2::uuid[], $3::text[], $4::jsonb[], $5::int[], $6::int[], $7::int[],
                         $8::int[], $9::jsonb[], $10::text[])
        AS t (job_id, idempotency_key, spec, priority, min_vram_mb, max_failures,
              max_train_steps, labels, traceparent)
), inserted AS (
    INSERT INTO jobs (job_id, owner, idempotency_key, spec, state, priority, min_vram_mb,
                      max_failures, max_train_steps, labels, traceparent, api_key_id)
    SELECT job_id, $1, NULLIF(idempotency_key, ''), spec, 'QUEUED', priority, min_vram_mb,
           max_failures, max_train_steps, labels, NULLIF(traceparent, ''), $11
    FROM input
    ON CONFLICT (owner, idempotency_key) DO NOTHING
    RETURNING *
), submitted AS (
    INSERT INTO job_events (job_id, kind, state)
    SELECT job_id, 'SUBMITTED', 'QUEUED' FROM inserted
)
SELECT * FROM inserted;

-- name: get_jobs_by_idempotency_key
SELECT * FROM jobs WHERE owner = $1 AND idempotency_key = ANY($2::text[]);

-- name: get_job
SELECT j.*, lorafleet_gpu_seconds(j.job_id) AS gpu_seconds
FROM jobs j WHERE j.job_id = $1 AND j.owner = $2;

-- name: get_job_any_owner
SELECT * FROM jobs WHERE job_id = $1;

-- name: list_jobs
-- Keyset pagination on (created_at, job_id), newest first. $3: '{}' matches every job.
SELECT j.*, lorafleet_gpu_seconds(j.job_id) AS gpu_seconds
FROM jobs j
WHERE owner = $1
  AND (cardinality($2::text[]) = 0 OR state = ANY($2::text[]))
  AND labels @> $3::jsonb
  AND ($4::timestamptz IS NULL OR (created_at, job_id) < ($4::timestamptz, $5::uuid))
ORDER BY created_at DESC, job_id DESC
LIMIT $6;

-- name: cancel_job
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

-- name: claim_job
-- One statement: pick the best claimable job for this machine, skipping rows other replicas
-- hold locked, and grant it a new lease with the next epoch.
-- $1 machine_id, $2 vram_mb, $3 new lease_id, $4 lease ttl seconds.
WITH candidate AS (
    SELECT j.job_id FROM jobs j
    WHERE j.state = 'QUEUED'
      AND j.min_vram_mb <= $2
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = j.job_id AND b.machine_id = $1)
    ORDER BY (j.epoch > 0) DESC, j.priority DESC, j.created_at, j.job_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), granted AS (
    UPDATE jobs j
    SET state = 'RUNNING', epoch = j.epoch + 1, lease_id = $3, machine_id = $1,
        lease_expires_at = now() + make_interval(secs => $4), updated_at = now()
    FROM candidate c WHERE j.job_id = c.job_id
    RETURNING j.*
), leased AS (
    INSERT INTO leases (lease_id, job_id, epoch, machine_id)
    SELECT lease_id, job_id, epoch, machine_id FROM granted
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step)
    SELECT job_id, 'LEASE_GRANTED', 'RUNNING', lease_id, machine_id, epoch, progress_step
    FROM granted
)
SELECT * FROM granted;

-- name: resume_lease
-- A worker reconnected holding ($1 lease, $2 epoch) on machine $3: keep it if still live.
WITH resumed AS (
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => $4), updated_at = now()
    WHERE lease_id = $1 AND epoch = $2 AND machine_id = $3 AND state = 'RUNNING'
    RETURNING *
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, step)
    SELECT job_id, 'LEASE_RESUMED', state, lease_id, machine_id, epoch, progress_step FROM resumed
)
SELECT * FROM resumed;

-- name: heartbeat
-- $1 lease, $2 epoch, $3 ttl s, $4 step, $5 loss, $6 lr, $7 s/step. Extends the lease.
WITH live AS (
    UPDATE jobs
    SET lease_expires_at = now() + make_interval(secs => $3),
        progress_step = $4, progress_loss = $5, progress_lr = $6, progress_s_per_step = $7,
        progress_machine_id = machine_id, progress_at = now(), updated_at = now()
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
    RETURNING job_id, machine_id, lease_id, epoch
), touched AS (
    UPDATE leases SET last_heartbeat_at = now() WHERE lease_id = (SELECT lease_id FROM live)
), logged AS (
    INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step, loss, seconds_per_step)
    SELECT job_id, 'HEARTBEAT', lease_id, machine_id, epoch, $4, $5, $7 FROM live
)
SELECT job_id FROM live;

-- name: expire_leases
-- The sweeper, safe on every replica: rows another replica is expiring are skipped.
WITH expired AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
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
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch)
    SELECT job_id, 'LEASE_EXPIRED', 'QUEUED', lease_id, machine_id, epoch FROM expired
)
SELECT job_id, lease_id, machine_id, epoch FROM expired;

-- name: drain_lease
-- The holder is stopping ($1 lease, $2 epoch, $3 reason): re-queue at once, no failure counted.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
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
-- $1 lease, $2 epoch, $3 class (NODE | INPUT | INTERNAL), $4 message.
-- NODE bans the machine and counts a failure; INTERNAL counts one; INPUT fails the job at once.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch, failures, max_failures FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
    FOR UPDATE
), decided AS (
    SELECT t.*,
           t.failures + CASE WHEN $3 = 'INPUT' THEN 0 ELSE 1 END AS new_failures,
           CASE WHEN $3 = 'INPUT' OR t.failures + 1 >= t.max_failures THEN 'FAILED'
                ELSE 'QUEUED' END AS new_state
    FROM target t
), updated AS (
    UPDATE jobs j
    SET state = d.new_state, failures = d.new_failures,
        lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        error = CASE WHEN d.new_state = 'FAILED' THEN $4 ELSE j.error END,
        failure_class = CASE WHEN d.new_state = 'FAILED' THEN $3 ELSE j.failure_class END,
        finished_at = CASE WHEN d.new_state = 'FAILED' THEN now() END,
        updated_at = now()
    FROM decided d WHERE j.job_id = d.job_id
    RETURNING j.*
), ended AS (
    UPDATE leases l SET ended_at = now(), end_reason = 'failed: ' || lower($3)
    FROM target t WHERE l.lease_id = t.lease_id
), banned AS (
    INSERT INTO bans (job_id, machine_id, reason)
    SELECT job_id, machine_id, $4 FROM target WHERE $3 = 'NODE'
    ON CONFLICT DO NOTHING
), logged AS (
    INSERT INTO job_events (job_id, kind, state, lease_id, machine_id, epoch, message, failure_class)
    SELECT job_id, 'ATTEMPT_FAILED', new_state, lease_id, machine_id, epoch, $4, $3 FROM decided
    UNION ALL
    SELECT job_id, 'FAILED', 'FAILED', lease_id, machine_id, epoch, $4, $3 FROM decided
    WHERE new_state = 'FAILED'
)
SELECT * FROM updated;

-- name: commit_checkpoint
-- $1 lease, $2 epoch, $3 step, $4 key, $5 bytes, $6 sha256. Recorded only under the live lease.
WITH live AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
    FOR UPDATE
), recorded AS (
    INSERT INTO checkpoints (job_id, step, epoch, key, size_bytes, sha256)
    SELECT job_id, $3, epoch, $4, $5, $6 FROM live
    ON CONFLICT (job_id, step, epoch) DO NOTHING
    RETURNING job_id
), newest AS (
    UPDATE jobs j
    SET checkpoint_step = $3, checkpoint_epoch = l.epoch, checkpoint_key = $4,
        checkpoint_bytes = $5, checkpoint_sha256 = $6, checkpoint_at = now(), updated_at = now()
    FROM live l WHERE j.job_id = l.job_id AND coalesce(j.checkpoint_step, -1) <= $3
), logged AS (
    INSERT INTO job_events (job_id, kind, lease_id, machine_id, epoch, step,
                            checkpoint_key, checkpoint_bytes, checkpoint_sha256)
    SELECT job_id, 'CHECKPOINT_COMMITTED', lease_id, machine_id, epoch, $3, $4, $5, $6 FROM live
)
SELECT job_id FROM live;

-- name: succeed_job
-- $1 lease, $2 epoch, $3 result key, $4 bytes, $5 sha256, $6 step, $7 loss.
WITH target AS (
    SELECT job_id, lease_id, machine_id, epoch FROM jobs
    WHERE lease_id = $1 AND epoch = $2 AND state = 'RUNNING'
    FOR UPDATE
), succeeded AS (
    UPDATE jobs j
    SET state = 'SUCCEEDED', lease_id = NULL, machine_id = NULL, lease_expires_at = NULL,
        result_key = $3, result_bytes = $4, result_sha256 = $5,
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
)
SELECT * FROM succeeded;

-- name: live_checkpoints
-- Committed and still stored, newest first.
SELECT * FROM checkpoints WHERE job_id = $1 AND deleted_at IS NULL
ORDER BY step DESC, epoch DESC;

-- name: checkpoints_to_delete
-- Beyond the newest $2 of a running job, or every one once the job has finished.
SELECT c.job_id, c.step, c.epoch, c.key FROM checkpoints c JOIN jobs j USING (job_id)
WHERE c.deleted_at IS NULL AND c.job_id = $1
  AND (j.state IN ('SUCCEEDED', 'FAILED', 'CANCELED')
       OR (c.step, c.epoch) NOT IN (
           SELECT step, epoch FROM checkpoints
           WHERE job_id = $1 AND deleted_at IS NULL
           ORDER BY step DESC, epoch DESC LIMIT $2));

-- name: finished_jobs_with_checkpoints
SELECT DISTINCT c.job_id FROM checkpoints c JOIN jobs j USING (job_id)
WHERE c.deleted_at IS NULL AND j.state IN ('SUCCEEDED', 'FAILED', 'CANCELED')
LIMIT $1;

-- name: mark_checkpoints_deleted
-- $1 job, $2 keys now gone from storage.
WITH marked AS (
    UPDATE checkpoints SET deleted_at = now()
    WHERE job_id = $1 AND key = ANY($2::text[]) AND deleted_at IS NULL
    RETURNING job_id, step, epoch, key
)
INSERT INTO job_events (job_id, kind, epoch, step, checkpoint_key)
SELECT job_id, 'CHECKPOINT_DELETED', epoch, step, key FROM marked;

-- name: upsert_machine
INSERT INTO machines (machine_id, provider_instance_id, gpu_model, vram_mb, qualified,
                      qualification, version)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (machine_id) DO UPDATE
SET provider_instance_id = EXCLUDED.provider_instance_id, gpu_model = EXCLUDED.gpu_model,
    vram_mb = EXCLUDED.vram_mb, qualified = EXCLUDED.qualified,
    qualification = EXCLUDED.qualification, version = EXCLUDED.version,
    last_seen_at = now();

-- name: touch_machine
UPDATE machines SET last_seen_at = now() WHERE machine_id = $1;

-- name: list_events
SELECT * FROM job_events WHERE job_id = $1 AND event_id > $2 ORDER BY event_id LIMIT $3;

-- name: count_queued
SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'QUEUED' LIMIT $1) q;

-- name: job_leases
SELECT * FROM leases WHERE job_id = $1 ORDER BY epoch;

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
