-- Machine ids expire: the sweeper deletes never-verified machines that nothing names
-- (expire_machines). These indexes keep that statement to the candidates it looks at.
CREATE INDEX machines_unverified_seen_idx ON machines (last_seen_at) WHERE identity_provider = '';
CREATE INDEX bans_machine_idx ON bans (machine_id);
