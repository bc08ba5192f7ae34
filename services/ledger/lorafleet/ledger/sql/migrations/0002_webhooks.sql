-- Webhooks: per job (spec.webhook_url) or per API key default, delivered from an outbox that is
-- written in the same transaction as the job event it announces.

ALTER TABLE api_keys
    ADD COLUMN webhook_url text,
    ADD COLUMN webhook_events text[] NOT NULL DEFAULT '{}',
    -- Signs every delivery for jobs submitted with this key (shown once, at key creation).
    ADD COLUMN webhook_secret text NOT NULL
        DEFAULT encode(sha256((gen_random_uuid()::text || gen_random_uuid()::text)::bytea), 'hex');

-- Which key submitted the job: its webhook default and signing secret apply.
ALTER TABLE jobs ADD COLUMN api_key_id text REFERENCES api_keys (key_id);

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

-- Wake every replica's delivery loop when an attempt ends for good (and tests waiting on it).
CREATE FUNCTION lorafleet_notify_webhook_done() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.delivered_at IS NOT NULL AND OLD.delivered_at IS NULL)
            OR (NEW.gave_up_at IS NOT NULL AND OLD.gave_up_at IS NULL) THEN
        PERFORM pg_notify('lorafleet_webhook_done', NEW.delivery_id::text);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER webhook_deliveries_done AFTER UPDATE ON webhook_deliveries
    FOR EACH ROW EXECUTE FUNCTION lorafleet_notify_webhook_done();
