-- Whether a machine is quarantined (granted nothing: claim_job, claim_sample_task): $2 node
-- faults, or $4 empty leases (lorafleet_empty_leases), in the last $3 s. One definition, for
-- the claims and for a queued job's waiting reason.
CREATE FUNCTION lorafleet_quarantined(machine text, fault_threshold integer, window_s float8,
                                      empty_lease_limit integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM leases q
            WHERE q.machine_id = machine AND q.end_reason = 'failed: node'
              AND q.ended_at > now() - make_interval(secs => window_s)) >= fault_threshold
        OR lorafleet_empty_leases(machine, window_s) >= empty_lease_limit
$$;

-- Whether job $1 (memory need $2) waits on the quarantine: some machine that could run it is
-- connected (holds a stream's session, seen within the window, qualified, with the memory,
-- not banned from the job), and every such machine is quarantined. The families a machine
-- serves are not recorded, so one of another family counts as able to run it.
CREATE FUNCTION lorafleet_waits_on_quarantine(job uuid, need_mb bigint, fault_threshold integer,
                                              window_s float8, empty_lease_limit integer)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT coalesce(bool_and(lorafleet_quarantined(m.machine_id, fault_threshold, window_s,
                                                   empty_lease_limit)), false)
    FROM machines m
    WHERE m.session_token_sha256 IS NOT NULL
      AND m.last_seen_at > now() - make_interval(secs => window_s)
      AND m.qualified AND m.vram_mb >= need_mb
      AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.job_id = job AND b.machine_id = m.machine_id)
$$;
