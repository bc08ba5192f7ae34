-- Which provider vouched for a machine's id on its current stream: 'salad', 'ec2', 'local', or
-- '' when the Hello carried no proof. An unverified stream never takes a verified machine's id,
-- and the scaler acts on provider instances only for verified machines.
ALTER TABLE machines ADD COLUMN identity_provider text NOT NULL DEFAULT '';
ALTER TABLE machines ADD COLUMN identity_verified_at timestamptz;
