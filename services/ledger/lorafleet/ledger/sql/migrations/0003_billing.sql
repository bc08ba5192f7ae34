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
