-- Whether a lease's training step ran compiled, as its holder says in its heartbeats
-- (Heartbeat.step_compiled; NULL: it did not say). The worker's word: the scaler uses it only to
-- choose what that node's own pace is compared with (a fresh eager node is not held to warm
-- compiled peers), never to judge another node (scaler/policy.py, "Slow node").
ALTER TABLE leases ADD COLUMN step_compiled boolean;
