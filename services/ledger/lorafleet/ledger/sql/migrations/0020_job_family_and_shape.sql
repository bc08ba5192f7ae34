-- Model families (docs/DESIGN.md, "What a node can hold" and "Job shape"). Copied out of the
-- spec at submit: the job's family (JobSpec.family), which claim_job offers only to workers
-- that serve it (Hello.families), and its shape (JobSpec.shape.key), which every figure keyed by
-- shape (paces, estimates, spend limits) reads. Jobs from before are SDXL jobs: every job the
-- ledger held was submitted when SDXL was the only family. Their shape keys are filled in by the
-- scheduler at start (Ledger.fill_warm_keys), from the one definition in Python; until then
-- they count for no pace figure. From here on jobs.min_vram_mb holds the job's memory need:
-- the spec's min_vram_mb or the family's estimate for its shape, the larger (core/fit.py).
ALTER TABLE jobs ADD COLUMN family text NOT NULL DEFAULT 'sdxl', ADD COLUMN shape_key text;
