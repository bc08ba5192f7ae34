"""The scheduler: the Postgres job ledger, the public JobService and the WorkerService stream."""
