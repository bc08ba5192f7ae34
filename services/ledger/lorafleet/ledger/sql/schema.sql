-- The current schema of the job ledger: what applying every migration in migrations/ produces,
-- written out as one file to read (no ALTERs to replay in one's head).
--
-- Maintained by hand, never generated: a change to the schema is a new migration in
-- migrations/ (applied ones are never edited; a checksum guard refuses that) AND the same
-- change made here, in place. tests/scheduler/test_schema.py builds one database from the
-- migrations and one from this file and fails with a diff of their catalogs (tables, columns,
-- constraints, indexes, functions with their bodies, triggers, sequences) until the two agree.
-- To see the catalog of any database the way that test does:
--     python -m lorafleet.scheduler.database catalog postgresql://...
-- The migration log (schema_migrations) is not part of the schema; migrate() creates it.

-- States and leases follow docs/DESIGN.md, "The job and its lease".

CREATE TABLE api_keys (
    key_id        text PRIMARY KEY,
    owner         text NOT NULL,
    -- sha256 of the random secret half of the key: the secret itself is never stored.
    secret_sha256 bytea NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    -- Webhooks: the key's default target for the jobs it submits (0002).
    webhook_url   text,
    webhook_events text[] NOT NULL DEFAULT '{}',
    -- Signs every delivery for jobs submitted with this key (shown once, at key creation).
    webhook_secret text NOT NULL
        DEFAULT encode(sha256((gen_random_uuid()::text || gen_random_uuid()::text)::bytea), 'hex'),
    -- A submit whose estimated cost would take the key's jobs past it is refused; NULL: none
    -- (0009).
    spend_limit_dollars double precision
        CHECK (spend_limit_dollars IS NULL OR spend_limit_dollars >= 0)
);

CREATE TABLE jobs (
    job_id           uuid PRIMARY KEY,
    owner            text NOT NULL,
    idempotency_key  text,
    spec             jsonb NOT NULL,
    state            text NOT NULL
        CHECK (state IN ('QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELED')),
    -- Copied out of the spec for the claim query's filter and order.
    priority         integer NOT NULL,
    -- The job's memory need (0020): the spec's min_vram_mb or the family's estimate for its
    -- shape, the larger (core/fit.py, vram_need_mb); claim_job grants only nodes that hold it.
    min_vram_mb      integer NOT NULL,
    max_failures     integer NOT NULL,
    max_train_steps  integer NOT NULL,
    labels           jsonb NOT NULL DEFAULT '{}',
    -- Attempt number: raised by every grant; the fencing token together with lease_id.
    epoch            bigint NOT NULL DEFAULT 0,
    failures         integer NOT NULL DEFAULT 0,
    lease_id         uuid,
    machine_id       text,
    lease_expires_at timestamptz,
    progress_step    bigint NOT NULL DEFAULT 0,
    progress_loss    real,
    progress_lr      real,
    progress_s_per_step real,
    progress_machine_id text,
    progress_at      timestamptz,
    -- The newest committed checkpoint (also in `checkpoints`), kept here for cheap reads.
    checkpoint_step  bigint,
    checkpoint_epoch bigint,
    checkpoint_key   text,
    checkpoint_bytes bigint,
    checkpoint_sha256 text,
    checkpoint_at    timestamptz,
    result_key       text,
    result_bytes     bigint,
    result_sha256    text,
    error            text,
    failure_class    text,
    traceparent      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    -- Which key submitted the job: its webhook default and signing secret apply.
    api_key_id       text REFERENCES api_keys (key_id),
    -- When the finished job's storage was last swept of objects the ledger never recorded
    -- (0008): once at finish, once more after its leases' upload URLs expired.
    storage_swept_at timestamptz,
    -- output_format both (0009): the kohya-format result file stored beside result_key's.
    result_kohya_key    text,
    result_kohya_bytes  bigint,
    result_kohya_sha256 text,
    -- Copied out of the spec for the claim's warm preference (0016): JobSpec.resident_key and
    -- compiled_shape_key; NULL (jobs from before, until the scheduler fills them) matches none.
    resident_key        text,
    compiled_shape_key  text,
    -- When the live lease last made verified progress (0017): its grant, then each checkpoint
    -- the store verified that crossed the job's checkpoint interval. Heartbeats do not move
    -- it; the sweeper revokes a lease that went too long without (stall_leases).
    lease_progress_at   timestamptz,
    -- The live lease's checkpoint interval where the scheduler chose it (0018:
    -- checkpointing_steps auto); NULL under a fixed one.
    lease_checkpoint_steps integer,
    -- The highest step the live lease committed (0018); NULL until its first checkpoint.
    lease_progress_step bigint,
    -- When the job last entered the queue (0018): its submit, or its last re-queue
    -- (jobs_mark_queued); the warm-dispatch fairness bound counts from here.
    queued_at           timestamptz NOT NULL DEFAULT now(),
    -- Copied out of the spec for the claim's warm preference (0019): JobSpec.adapter_shape_key;
    -- NULL (jobs from before, until the scheduler fills them) matches none.
    adapter_shape_key   text,
    -- Copied out of the spec (0020): JobSpec.family, offered only to workers that serve it
    -- (jobs from before: sdxl), and JobSpec.shape.key, what figures keyed by shape read (jobs
    -- from before: NULL until the scheduler fills them at start).
    family              text NOT NULL DEFAULT 'sdxl',
    shape_key           text,
    -- Failed attempts not blamed on the job (0021): node faults, stalls, errors from machines
    -- not in good standing; `failures` counts only those it is blamed for. A job fails at
    -- `max_node_faults` of them (larger than what a few machines can spend: one each).
    node_faults         integer NOT NULL DEFAULT 0,
    max_node_faults     integer GENERATED ALWAYS AS (greatest(10, 3 * max_failures)) STORED,
    UNIQUE (owner, idempotency_key),
    -- At most one live lease per job, and only a RUNNING job has one.
    CHECK ((state = 'RUNNING') = (lease_id IS NOT NULL)),
    CHECK ((state = 'RUNNING') = (lease_expires_at IS NOT NULL))
);

-- The claim order: re-queued jobs (epoch > 0) first, then priority, then age.
CREATE INDEX jobs_queue_idx ON jobs (((epoch > 0)) DESC, priority DESC, created_at, job_id)
    WHERE state = 'QUEUED';
CREATE INDEX jobs_lease_expiry_idx ON jobs (lease_expires_at) WHERE state = 'RUNNING';
CREATE UNIQUE INDEX jobs_lease_idx ON jobs (lease_id) WHERE lease_id IS NOT NULL;
CREATE INDEX jobs_owner_page_idx ON jobs (owner, created_at DESC, job_id DESC);
CREATE INDEX jobs_labels_idx ON jobs USING gin (labels jsonb_path_ops);
-- When the work last ran out: the newest finish (the scaler's idle grace, 0007).
CREATE INDEX jobs_finished_idx ON jobs (finished_at) WHERE finished_at IS NOT NULL;

-- Every lease ever granted: the audit trail of who held what, and billing.
CREATE TABLE leases (
    lease_id          uuid PRIMARY KEY,
    job_id            uuid NOT NULL REFERENCES jobs (job_id),
    epoch             bigint NOT NULL,
    machine_id        text NOT NULL,
    granted_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    ended_at          timestamptz,
    end_reason        text,
    -- sha256 of the secret given with the grant; resuming after a reconnect must present it (0006).
    secret_sha256     bytea,
    -- The holder's pace as it reports it (0007): its latest seconds per step, and the first and
    -- last step it heartbeated. A claim: the scaler believes it only against the holder itself.
    seconds_per_step  real,
    first_step        bigint,
    last_step         bigint,
    -- Whether its step ran compiled, as the holder says (0023; NULL: it did not say): the
    -- scaler compares a node's pace only with what a node of its compile state runs.
    step_compiled     boolean,
    -- Its grant span's W3C traceparent (0025; NULL: granted before): a resume after a
    -- reconnect puts the scheduler's spans for the lease under its grant again.
    traceparent       text,
    -- Whether the fleet believed the failure that ended it (0028, fail_attempt): an INTERNAL
    -- error counted against the job, or a confirmed input fault. Not an empty lease then.
    fault_believed    boolean NOT NULL DEFAULT false,
    -- One grant per attempt, ever: the ledger itself forbids granting a job twice.
    UNIQUE (job_id, epoch)
);
CREATE INDEX leases_machine_idx ON leases (machine_id, granted_at);
-- The scaler's observations (every recent lease) and estimates (verified completions) (0014).
CREATE INDEX leases_granted_idx ON leases (granted_at);
CREATE INDEX leases_succeeded_idx ON leases (ended_at) WHERE end_reason = 'succeeded';
CREATE INDEX leases_node_fault_idx ON leases (machine_id, ended_at)
    WHERE end_reason = 'failed: node';

CREATE TABLE checkpoints (
    job_id       uuid NOT NULL REFERENCES jobs (job_id),
    step         bigint NOT NULL,
    epoch        bigint NOT NULL,
    key          text NOT NULL,
    size_bytes   bigint NOT NULL,
    sha256       text NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    -- Set once the object is gone from storage (retention, or the job finished).
    deleted_at   timestamptz,
    PRIMARY KEY (job_id, step, epoch)
);

-- Generated prior-preservation class images, recorded like checkpoints: keyed per lease
-- (jobs/<job_id>/class_images/<index>-e<epoch>.png), recorded only under the live lease and only
-- once the store held exactly the announced bytes. A later holder of the job is given these (the
-- newest epoch's per index, with their sha256) and nothing else a holder left in storage.
CREATE TABLE class_images (
    job_id       uuid NOT NULL REFERENCES jobs (job_id),
    image_index  integer NOT NULL,
    epoch        bigint NOT NULL,
    key          text NOT NULL,
    size_bytes   bigint NOT NULL,
    sha256       text NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, image_index, epoch)
);

-- A job is never leased again to a machine on which it failed with a node fault.
CREATE TABLE bans (
    job_id     uuid NOT NULL REFERENCES jobs (job_id),
    machine_id text NOT NULL,
    reason     text NOT NULL,
    banned_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, machine_id)
);
-- The machine expiry's look-up (0015).
CREATE INDEX bans_machine_idx ON bans (machine_id);

CREATE TABLE machines (
    machine_id           text PRIMARY KEY,
    provider_instance_id text NOT NULL DEFAULT '',
    gpu_model            text NOT NULL DEFAULT '',
    vram_mb              bigint NOT NULL DEFAULT 0,
    qualified            boolean NOT NULL DEFAULT false,
    qualification        jsonb NOT NULL DEFAULT '{}',
    version              text NOT NULL DEFAULT '',
    first_seen_at        timestamptz NOT NULL DEFAULT now(),
    last_seen_at         timestamptz NOT NULL DEFAULT now(),
    -- sha256 of the live stream's session token: another stream cannot take this machine id
    -- over until the machine has been silent for a lease TTL (0006).
    session_token_sha256 bytea,
    -- Which provider vouched for the id on the current stream ('' : unverified; 0012).
    identity_provider    text NOT NULL DEFAULT '',
    identity_verified_at timestamptz,
    -- The model families it serves, as its Hello announces them (0028).
    families             text[] NOT NULL DEFAULT '{}'
);
-- Never-verified machines expire once silent and named by nothing (0015, expire_machines).
CREATE INDEX machines_unverified_seen_idx ON machines (last_seen_at) WHERE identity_provider = '';

-- Replicas say they are alive (every sweep); one that starts after every replica was down
-- gives workers a lease TTL to reconnect before their leases expire (0006).
CREATE TABLE scheduler_replicas (
    replica_id   text PRIMARY KEY,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);

-- The scaler's decisions (0007): what, on which instance or machine, why, the figures behind it,
-- whether it was carried out and the error if not. A HOLD repeated tick after tick folds into
-- one row (`repeats`, `last_at`).
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

-- Append-only: the timeline, billing and WatchJob read it.
CREATE TABLE job_events (
    event_id         bigserial PRIMARY KEY,
    job_id           uuid NOT NULL REFERENCES jobs (job_id),
    kind             text NOT NULL,
    at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    machine_id       text,
    lease_id         uuid,
    epoch            bigint,
    step             bigint,
    loss             real,
    seconds_per_step real,
    message          text,
    failure_class    text,
    state            text,
    checkpoint_key   text,
    checkpoint_bytes bigint,
    checkpoint_sha256 text
);
CREATE INDEX job_events_job_idx ON job_events (job_id, event_id);

-- Cross-replica wake-ups (LISTEN/NOTIFY), fired by the ledger's own transitions so that no code
-- path can forget one. Notifications are sent at commit; identical ones in a transaction merge.

-- A job became claimable: every replica wakes its idle workers.
CREATE FUNCTION lorafleet_notify_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'QUEUED' AND (TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM 'QUEUED') THEN
        PERFORM pg_notify('lorafleet_work', '');
    END IF;
    -- A live lease ended (cancel, expiry, drain, finish): the replica holding its stream tells
    -- the worker, if it is still listening.
    IF TG_OP = 'UPDATE' AND OLD.lease_id IS NOT NULL
            AND OLD.lease_id IS DISTINCT FROM NEW.lease_id THEN
        PERFORM pg_notify('lorafleet_lease_ended', OLD.lease_id::text || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_notify AFTER INSERT OR UPDATE OF state, lease_id ON jobs
    FOR EACH ROW EXECUTE FUNCTION lorafleet_notify_work();

-- A job's queued_at follows it back into the queue, whichever statement re-queues it.
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

-- A job's timeline grew: WatchJob streams on every replica read the new events.
CREATE FUNCTION lorafleet_notify_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('lorafleet_job_event', NEW.job_id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    FOR EACH ROW EXECUTE FUNCTION lorafleet_notify_event();

-- Webhooks: per job (spec.webhook_url) or per API key default, delivered from an outbox that is
-- written in the same transaction as the job event it announces.

CREATE TABLE webhook_deliveries (
    delivery_id     bigserial PRIMARY KEY,
    job_id          uuid NOT NULL REFERENCES jobs (job_id),
    event_id        bigint NOT NULL REFERENCES job_events (event_id),
    event           text NOT NULL,
    url             text NOT NULL,
    payload         jsonb NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    -- Also the claim: a replica that takes a delivery pushes this forward while it tries.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_status     integer,
    last_error      text,
    delivered_at    timestamptz,
    gave_up_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at)
    WHERE delivered_at IS NULL AND gave_up_at IS NULL;
CREATE INDEX webhook_deliveries_job_idx ON webhook_deliveries (job_id, delivery_id);

CREATE FUNCTION lorafleet_enqueue_webhook() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    event_name text;
    job        jobs%ROWTYPE;
    key        api_keys%ROWTYPE;
    target     text;
    wanted     text[];
BEGIN
    event_name := CASE NEW.kind
        WHEN 'CHECKPOINT_COMMITTED' THEN 'checkpoint'
        WHEN 'SUCCEEDED' THEN 'succeeded'
        WHEN 'FAILED' THEN 'failed'
        WHEN 'CANCELED' THEN 'canceled'
        WHEN 'SAMPLES' THEN 'samples'
    END;
    IF event_name IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT * INTO job FROM jobs WHERE job_id = NEW.job_id;
    SELECT * INTO key FROM api_keys WHERE key_id = job.api_key_id;
    IF NOT FOUND THEN
        RETURN NULL;  -- no submitting key (an admin insert): nothing to sign deliveries with
    END IF;
    IF coalesce(job.spec ->> 'webhook_url', '') <> '' THEN
        target := job.spec ->> 'webhook_url';
        wanted := ARRAY(SELECT jsonb_array_elements_text(job.spec -> 'webhook_events'));
    ELSE
        target := key.webhook_url;
        wanted := key.webhook_events;
    END IF;
    IF coalesce(target, '') = '' OR NOT (cardinality(wanted) = 0 OR event_name = ANY (wanted)) THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_deliveries (job_id, event_id, event, url, payload)
    VALUES (NEW.job_id, NEW.event_id, event_name, target, jsonb_build_object(
        'event', 'job.' || event_name,
        'job_id', NEW.job_id,
        'event_id', NEW.event_id,
        'at', NEW.at,
        'state', job.state,
        'step', NEW.step,
        'epoch', NEW.epoch,
        'machine_id', NEW.machine_id,
        'message', NEW.message,
        'labels', job.labels,
        'checkpoint', CASE WHEN NEW.checkpoint_key IS NULL THEN NULL ELSE jsonb_build_object(
            'key', NEW.checkpoint_key, 'size_bytes', NEW.checkpoint_bytes,
            'sha256', NEW.checkpoint_sha256) END,
        'result', CASE WHEN job.result_key IS NULL THEN NULL ELSE jsonb_build_object(
            'key', job.result_key, 'size_bytes', job.result_bytes,
            'sha256', job.result_sha256) END
    ));
    PERFORM pg_notify('lorafleet_webhook', '');
    RETURN NULL;
END $$;

CREATE TRIGGER job_events_webhook AFTER INSERT ON job_events
    FOR EACH ROW EXECUTE FUNCTION lorafleet_enqueue_webhook();

-- Billable accelerator seconds of a job over all its leases: from grant to end, or to the last
-- heartbeat for a lease that expired (the node's work after it is unknown); a live lease counts
-- up to now.
CREATE FUNCTION lorafleet_gpu_seconds(job uuid) RETURNS double precision LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(extract(epoch FROM
               CASE WHEN l.end_reason = 'expired' THEN l.last_heartbeat_at
                    ELSE coalesce(l.ended_at, greatest(l.last_heartbeat_at, now())) END
               - l.granted_at)), 0)::double precision
    FROM leases l WHERE l.job_id = job
$$;

-- Sample tasks (0011): validation images made on the fleet, leased like jobs, after training.
CREATE TABLE sample_tasks (
    task_id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    job_id           uuid NOT NULL REFERENCES jobs (job_id),
    step             bigint NOT NULL,
    -- The LoRA weights at `step`: a committed checkpoint, or the result.
    weights_key      text NOT NULL,
    weights_sha256   text NOT NULL,
    weights_is_checkpoint boolean NOT NULL,
    -- prompts, negative_prompt, guidance_scale, inference_steps, seed, resolution,
    -- images_per_prompt: everything the images depend on besides the weights.
    settings         jsonb NOT NULL,
    state            text NOT NULL DEFAULT 'QUEUED'
        CHECK (state IN ('QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED')),
    epoch            bigint NOT NULL DEFAULT 0,
    failures         integer NOT NULL DEFAULT 0,
    max_failures     integer NOT NULL DEFAULT 3,
    lease_id         uuid UNIQUE,
    machine_id       text,
    lease_expires_at timestamptz,
    secret_sha256    bytea,
    granted_at       timestamptz,
    -- Machines this task failed on (node or internal faults): never leased to them again.
    banned_machines  text[] NOT NULL DEFAULT '{}',
    -- [{"prompt_index", "image_index", "key", "size_bytes", "sha256"}] once SUCCEEDED.
    images           jsonb NOT NULL DEFAULT '[]',
    error            text,
    -- Worker-seconds spent on the task over all its leases.
    busy_seconds     double precision NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz
);
CREATE INDEX sample_tasks_queued_idx ON sample_tasks (created_at) WHERE state = 'QUEUED';
CREATE INDEX sample_tasks_job_idx ON sample_tasks (job_id, step);
CREATE INDEX sample_tasks_running_idx ON sample_tasks (lease_expires_at) WHERE state = 'RUNNING';

-- The interval a lease is judged by when it has none of its own (0022): an auto spec under a
-- lease granted before 0018. The spec's fixed default before auto, and the interval the stall
-- bound (lease_progress_timeout_s) is stated for.
CREATE FUNCTION lorafleet_reference_interval() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT 100
$$;

-- Steps between a job's checkpoints under its live lease: the lease's chosen interval, else the
-- spec's, else the reference interval. Never 0.
CREATE FUNCTION lorafleet_lease_interval(spec jsonb, lease_steps integer)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN coalesce(lease_steps, 0) > 0 THEN lease_steps
                WHEN coalesce((spec ->> 'checkpointing_steps')::int, 0) > 0
                    THEN (spec ->> 'checkpointing_steps')::int
                ELSE lorafleet_reference_interval() END
$$;

-- Leases of machine $1 that ended in the last $2 s without work: given up by a Ready, drained,
-- expired or failed (as its holder said: input, internal) with no checkpoint recorded under
-- them. Past a limit the machine is granted
-- nothing (claim_job): taking and dropping leases is how a stream collects their URLs.
-- A failure the fleet believed (0028, `fault_believed`: an INTERNAL error counted against the
-- job, a confirmed input fault) is not counted, nor an input fault the fleet later accepted as
-- the job's (the job failed as INPUT, confirmed by fail_attempt, which counts no node fault:
-- not one that failed at max_node_faults; 0026); one it did not believe is.
CREATE FUNCTION lorafleet_empty_leases(machine text, window_s float8) RETURNS bigint
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

-- Whether a machine is quarantined (granted nothing: claim_job, claim_sample_task): $2 node
-- faults, or $4 empty leases (lorafleet_empty_leases), in the last $3 s. One definition, for
-- the claims and for a queued job's waiting reason (0027).
CREATE FUNCTION lorafleet_quarantined(machine text, fault_threshold integer, window_s float8,
                                      empty_lease_limit integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM leases q
            WHERE q.machine_id = machine AND q.end_reason = 'failed: node'
              AND q.ended_at > now() - make_interval(secs => window_s)) >= fault_threshold
        OR lorafleet_empty_leases(machine, window_s) >= empty_lease_limit
$$;

-- The connected machines that could run job $1 (memory need $2; 0028, 0029): holding a stream's session,
-- seen within the last $3 s, qualified, with the memory, serving the job's family, not banned
-- from the job. Whether they are quarantined is the caller's question.
CREATE FUNCTION lorafleet_able_machines(job uuid, need_mb bigint, window_s float8)
RETURNS SETOF text LANGUAGE sql STABLE AS $$
    SELECT m.machine_id FROM machines m
    WHERE m.session_token_sha256 IS NOT NULL
      AND m.last_seen_at > now() - make_interval(secs => window_s)
      AND m.qualified AND m.vram_mb >= need_mb
      AND (SELECT j.family FROM jobs j WHERE j.job_id = job) = ANY (m.families)
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = job AND b.machine_id = m.machine_id)
$$;

-- Why QUEUED job $1 waits (0029; Job.waiting_reason; NULL for a job in another state): what ended its
-- newest attempt, unless a newer grant runs it; then the machines: every connected machine
-- that could run it quarantined ($2 node faults, $3 window s, $4 empty leases: claim_job's
-- bounds), none connected that could, or (for a job no attempt of which ended) how many could
-- once free. Derived when read, so nothing has to clear it.
CREATE FUNCTION lorafleet_waiting_reason(job uuid, fault_threshold integer, window_s float8,
                                         empty_lease_limit integer)
RETURNS text LANGUAGE sql STABLE AS $$
    WITH j AS (
        SELECT job_id, min_vram_mb, family FROM jobs WHERE job_id = job AND state = 'QUEUED'
    ), attempt AS (
        SELECT CASE e.kind
            WHEN 'ATTEMPT_FAILED' THEN
                'attempt ' || e.epoch || ' failed (' || lower(coalesce(e.failure_class, 'node'))
                || ' fault' || coalesce(': ' || nullif(e.message, ''), '') || '); '
                || CASE WHEN e.failure_class = 'INPUT'
                        THEN 'waiting for a second machine to confirm it before the job fails'
                        ELSE 'waiting for another machine' END
            WHEN 'DRAINED' THEN
                'attempt ' || e.epoch || ' drained'
                || coalesce(' (' || nullif(e.message, '') || ')', '')
                || '; waiting for a machine to resume it'
            WHEN 'LEASE_EXPIRED' THEN
                'attempt ' || e.epoch || ' expired: its machine went silent;'
                || ' waiting for a machine to resume it'
        END AS text
        FROM job_events e
        WHERE e.job_id = job
          AND e.kind IN ('LEASE_GRANTED', 'ATTEMPT_FAILED', 'DRAINED', 'LEASE_EXPIRED')
        ORDER BY e.event_id DESC LIMIT 1
    ), able AS (
        SELECT count(*) AS machines,
               count(*) FILTER (WHERE NOT lorafleet_quarantined(a, fault_threshold, window_s,
                                                               empty_lease_limit)) AS free
        FROM j, lorafleet_able_machines(j.job_id, j.min_vram_mb, window_s) a
    )
    SELECT nullif(concat_ws('; ', (SELECT text FROM attempt),
        CASE WHEN able.machines = 0 THEN
                 'no connected machine can run it (qualified, serving the ' || j.family
                 || ' family' || CASE WHEN j.min_vram_mb > 0
                                      THEN ', with ' || j.min_vram_mb || ' MiB of GPU memory'
                                      ELSE '' END
                 || ', not banned from it); waiting for one to connect'
             WHEN able.free = 0 THEN
                 'every connected machine that could run it is quarantined (too many node'
                 || ' faults or leases ended without work within the quarantine window);'
                 || ' waiting for the window to pass or for another machine'
             WHEN (SELECT text FROM attempt) IS NULL THEN
                 'waiting for one of the ' || able.free || ' connected machines that can run'
                 || ' it to be free (jobs of higher priority, or submitted earlier, go first)'
        END), '')
    FROM j, able
$$;

-- The settings of a job's validation images, from its spec (defaults for older specs).
CREATE FUNCTION lorafleet_sample_settings(spec jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'prompts',
            CASE WHEN coalesce(spec ->> 'validation_prompt', '') <> ''
                 THEN jsonb_build_array(spec ->> 'validation_prompt') ELSE '[]'::jsonb END
            || coalesce(spec -> 'validation_prompts', '[]'::jsonb),
        'negative_prompt', coalesce(spec ->> 'validation_negative_prompt', ''),
        'guidance_scale', coalesce((spec ->> 'validation_guidance_scale')::float8, 5.0),
        'inference_steps', coalesce((spec ->> 'validation_inference_steps')::int, 30),
        'seed', coalesce((spec ->> 'seed')::bigint, 0),
        'resolution', coalesce((spec ->> 'resolution')::int, 1024),
        'images_per_prompt', coalesce((spec ->> 'num_validation_images')::int, 4))
$$;

-- A task became claimable, or its lease ended: the same wake-ups as a job's.
CREATE FUNCTION lorafleet_notify_sample_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'QUEUED' AND (TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM 'QUEUED') THEN
        PERFORM pg_notify('lorafleet_work', '');
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.lease_id IS NOT NULL
            AND OLD.lease_id IS DISTINCT FROM NEW.lease_id THEN
        PERFORM pg_notify('lorafleet_lease_ended', OLD.lease_id::text || ' ' || NEW.state);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER sample_tasks_notify AFTER INSERT OR UPDATE OF state, lease_id ON sample_tasks
    FOR EACH ROW EXECUTE FUNCTION lorafleet_notify_sample_task();

-- Whether a machine is one of the operator's own (0028): vouched for on its current stream by
-- one of `operator_providers` (lorafleet up's local supervisor, EC2 in the operator's account).
CREATE FUNCTION lorafleet_operator_run(machine text, operator_providers text[]) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM machines m
                   WHERE m.machine_id = machine AND m.identity_provider = ANY (operator_providers))
$$;

-- A machine in good standing for a job submitted at `submitted_at` (0021, 0024): a provider
-- vouched for it; it delivered a verified result at least `min_age_s` (standing_min_age_s, 6 h)
-- before the job was submitted, with no node fault since; and of its last 10 attempts that
-- ended succeeded or failed, at least half succeeded. Only such machines' internal errors (and
-- the operator's own machines': lorafleet_operator_run) are blamed on a job, and only two of them confirm an input fault (fail_attempt): a group of
-- fresh machines arriving together has no say over any job submitted before it is hours old.
CREATE FUNCTION lorafleet_good_standing(machine text, submitted_at timestamptz, min_age_s float8)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM machines m
                   WHERE m.machine_id = machine AND m.identity_provider <> '')
       AND EXISTS (SELECT 1 FROM leases s
                   WHERE s.machine_id = machine AND s.end_reason = 'succeeded'
                     AND s.ended_at <= submitted_at - make_interval(secs => min_age_s)
                     AND s.ended_at > coalesce((SELECT max(q.ended_at) FROM leases q
                                                WHERE q.machine_id = machine
                                                  AND q.end_reason = 'failed: node'),
                                               '-infinity'))
       AND (SELECT 2 * count(*) FILTER (WHERE r.end_reason = 'succeeded') >= count(*)
            FROM (SELECT l.end_reason FROM leases l
                  WHERE l.machine_id = machine
                    AND (l.end_reason = 'succeeded' OR l.end_reason LIKE 'failed: %')
                  ORDER BY l.ended_at DESC
                  LIMIT 10) r)
$$;

-- The reference pace per GPU class (0021), in seconds per 1024x1024 image step: what the
-- scaler judges a node slow against beside its live peers; learned only from machines in the
-- fleet for hours, moved at a bounded rate (scaler/policy.py). A pinned class is not read.
CREATE TABLE pace_references (
    gpu_class        text PRIMARY KEY,
    seconds_per_step float8 NOT NULL CHECK (seconds_per_step > 0),
    machines         integer NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
