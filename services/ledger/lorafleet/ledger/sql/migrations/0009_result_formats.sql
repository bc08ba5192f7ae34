-- A job with output_format both stores two result files: the diffusers one (result_key) and
-- the kohya-format one beside it, recorded here once the store verified it like the first.
ALTER TABLE jobs ADD COLUMN result_kohya_key text;
ALTER TABLE jobs ADD COLUMN result_kohya_bytes bigint;
ALTER TABLE jobs ADD COLUMN result_kohya_sha256 text;
