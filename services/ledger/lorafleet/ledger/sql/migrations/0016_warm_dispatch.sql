-- Warm dispatch: the keys a worker's warm state is matched against in claim_job, copied out of
-- the spec at submit (JobSpec.resident_key and compiled_shape_key, defined once in Python).
-- Unfinished jobs from before are filled in by the scheduler at start (Ledger.fill_warm_keys);
-- until then they match no worker's warm state and are claimed in strict queue order.
ALTER TABLE jobs ADD COLUMN resident_key text, ADD COLUMN compiled_shape_key text;
