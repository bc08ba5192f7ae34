-- Good standing that a group of fresh machines cannot earn quickly (issue 30, item 5). Before,
-- one verified result of a machine's own made it a machine whose internal errors are blamed on
-- a job: three machines of one holder that each delivered one garbage result could then spend
-- any job's max_failures, and two strangers' machines could fail any job by calling its input
-- bad. A machine's word against a job now counts only if its standing predates the job:
--   * a provider vouched for it;
--   * it delivered a verified result at least `min_age_s` (the scheduler's
--     standing_min_age_s, 6 h) before the job was submitted, with no node fault since;
--   * of its last 10 attempts that ended succeeded or failed, at least half succeeded (a
--     machine failing most of what it is handed is broken, whatever it did before).
-- fail_attempt asks it for internal errors (toward max_failures) and for both machines of an
-- input fault's confirmation; it is asked again at every failure of the job, so attempts on a
-- machine that has gone bad since stop counting.
DROP FUNCTION lorafleet_good_standing(text);

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
