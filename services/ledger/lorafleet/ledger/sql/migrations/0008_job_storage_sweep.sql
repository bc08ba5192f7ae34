-- A finished job's storage is swept of everything the ledger never recorded: a checkpoint or
-- result stored by a lease that ended before announcing it (or whose announcement was refused)
-- would otherwise stay forever, since retention only deletes recorded keys. Swept once when the
-- job finishes and once more after the last upload URL of its leases has expired.
ALTER TABLE jobs ADD COLUMN storage_swept_at timestamptz;
