-- Warm dispatch by adapter shape: JobSpec.adapter_shape_key copied out of the spec at submit,
-- matched in claim_job against the parked adapter shapes a worker says its resident model holds
-- (a lease of one of them re-initialises those adapters in place). Unfinished jobs from before
-- are filled in by the scheduler at start (Ledger.fill_warm_keys); until then they match none.
ALTER TABLE jobs ADD COLUMN adapter_shape_key text;
