-- Sample tasks (issue 13): a job's validation images are made by tasks of their own on the
-- fleet, leased like jobs (lease_id, epoch, expiry, failure classes, bans) but always after
-- training work. Queued by the ledger itself when a checkpoint commits or the result is stored.
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

-- Webhooks: a `samples` event when a sample task stored its images.
CREATE OR REPLACE FUNCTION lorafleet_enqueue_webhook() RETURNS trigger LANGUAGE plpgsql AS $$
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
