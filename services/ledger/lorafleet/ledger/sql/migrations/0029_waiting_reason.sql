-- A queued job's waiting reason, one definition for get_job and list_jobs (each had a copy),
-- and one more case: a job no attempt of which ever started said nothing, whether no connected
-- machine could run it (none of its family, its memory, its qualification) or all that could
-- were busy.

-- The connected machines that could run job $1 (memory need $2): holding a stream's session,
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

-- Its one caller was the waiting reason, below.
DROP FUNCTION lorafleet_waits_on_quarantine(uuid, bigint, integer, float8, integer);

-- Why QUEUED job $1 waits (Job.waiting_reason; NULL for a job in another state): what ended its
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
