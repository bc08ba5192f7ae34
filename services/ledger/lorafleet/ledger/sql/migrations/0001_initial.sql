-- The job ledger. States and leases follow DESIGN.md ("The job and its lease").

CREATE TABLE api_keys (
    key_id        text PRIMARY KEY,
    owner         text NOT NULL,
    -- sha256 of the random secret half of the key: the secret itself is never stored.
    secret_sha256 bytea NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
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
    -- One grant per attempt, ever: the ledger itself forbids granting a job twice.
    UNIQUE (job_id, epoch)
);
CREATE INDEX leases_machine_idx ON leases (machine_id, granted_at);

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

-- A job is never leased again to a machine on which it failed with a node fault.
CREATE TABLE bans (
    job_id     uuid NOT NULL REFERENCES jobs (job_id),
    machine_id text NOT NULL,
    reason     text NOT NULL,
    banned_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, machine_id)
);

CREATE TABLE machines (
    machine_id           text PRIMARY KEY,
    provider_instance_id text NOT NULL DEFAULT '',
    gpu_model            text NOT NULL DEFAULT '',
    vram_mb              bigint NOT NULL DEFAULT 0,
    qualified            boolean NOT NULL DEFAULT false,
    qualification        jsonb NOT NULL DEFAULT '{}',
    version              text NOT NULL DEFAULT '',
    first_seen_at        timestamptz NOT NULL DEFAULT now(),
    last_seen_at         timestamptz NOT NULL DEFAULT now()
);

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

-- A job's timeline grew: WatchJob streams on every replica read the new events.
CREATE FUNCTION lorafleet_notify_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('lorafleet_job_event', NEW.job_id::text);
    RETURN NULL;
END $$;

CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    FOR EACH ROW EXECUTE FUNCTION lorafleet_notify_event();
