"""The scheduler: the public JobService and the WorkerService stream, over the ledger
(`lorafleet.ledger`, the Postgres truth that the scaler reads too).

Both sides follow one path: a servicer (`servicers.py`) decodes each request into domain values
(`lorafleet.core.serde`), one handler method acts on them, and the ledger persists.

* JobService: `servicers.JobServicer` → `job_handler.JobHandler` → `Ledger`.
* WorkerService.Connect: `servicers.WorkerServicer` → `worker_handler.WorkerHandler` →
  `Ledger`; beside it `dispatcher.Dispatcher`, which tells workers what the ledger decided
  without being asked (grants, revocations), and `sessions.WorkerSessions`, the registry of
  connected workers, each `WorkerSession` with its state (changed only by the named
  transitions of `sessions.TRANSITIONS`), its lease (a `TrainingLease` or a `SampleLease`),
  its bounds and its send queue (`send`; the servicer writes the queue to the stream).

The whole design, with the same map in prose: docs/DESIGN.md.

A map of the worker stream, for the questions a newcomer asks first:

Where a worker connects.
    `WorkerServicer.Connect` bounds streams per peer address (`WorkerHandler.admit_stream`,
    `sessions.StreamGate`), checks the worker token (`auth.check_worker_token`), reads the
    Hello within `hello_timeout_s`, decodes it (`serde.hello_from_proto`) and calls
    `WorkerHandler.connect`: the provider's proof of the machine id is verified, Hellos are
    bounded (`StreamGate.admit_hello`: per verified machine, else per worker token), the
    machine id is claimed for this stream (`Ledger.claim_machine_session`), the machine
    recorded (`upsert_machine`), sample tasks it held given back
    (`release_machine_sample_tasks`), a held lease resumed if the worker presents its secret
    (`resume_lease`), and the session registered (`WorkerSessions.add`). Then `Connect` runs
    two loops: it reads each message (`WorkerServicer._receive`: rate bound, decode, one
    handler method) and writes the session's outbox. When either ends,
    `WorkerHandler.disconnected` closes the session.

Where a lease is granted.
    `Dispatcher.offer`, for one idle session: `Ledger.claim_job` (the `claim_job` query in
    `ledger/sql/queries.sql`: one statement, `FOR UPDATE SKIP LOCKED`, jobs with progress
    first, bans respected; among jobs of one class, those the worker's Ready says it holds
    warm, within `warm_dispatch_bound_s`) makes the lease; `UrlSigner.lease_urls` signs its
    URLs; `checkpoint_interval.CheckpointIntervals` chooses its interval where the job's
    `checkpointing_steps` is auto (0); `LeaseGranted` is sent. With no training job to
    claim, `Dispatcher._offer_sample_task` grants a sample task instead. `offer` runs when a
    worker says Ready (`WorkerHandler.ready`) and in every dispatch round (`Dispatcher.run` →
    `_dispatch_round`), which the ledger's NOTIFY on `lorafleet_work` wakes on every replica.

Where a checkpoint goes from the stream into the ledger.
    In the worker, the training loop's `on_checkpoint` hook hands a snapshot to
    `worker.lease_runner.LeaseRunner._on_checkpoint`; `worker.uploads.CheckpointPipeline`
    uploads it (`LeaseUploads.upload_checkpoint`: serialise, `UrlsRequested`, PUT) and sends
    `CheckpointCommitted` (stored, not yet recorded). Here: `WorkerServicer._receive` →
    `serde.checkpoint_report_from_proto` (fields) → `WorkerHandler.checkpoint_committed`:
    fenced by the stream (`WorkerSession.training_lease`), key checked
    (`serde.check_checkpoint_key`), the object verified in the store
    (`_stored_as_announced`) and in its format (`_checkpoint_in_format`), then
    `Ledger.commit_checkpoint` (the `commit_checkpoint` query, fenced by lease and epoch);
    old checkpoints are pruned after (`Sweeper.prune_checkpoints`).

Where expiry and revocation happen.
    Expiry is the sweeper's, on every replica: `Sweeper.sweep_once` →
    `Ledger.expire_leases` (and `expire_sample_tasks`) re-queues leases whose heartbeats
    stopped for a TTL (`WorkerHandler.heartbeat` → `Ledger.heartbeat` extends them). Any end
    of a live lease (expiry, cancel via `JobHandler.cancel`, drain, a newer epoch) fires the
    `lorafleet_lease_ended` NOTIFY from the ledger's trigger; the replica holding that stream
    revokes it (`Dispatcher._on_lease_ended` → `Dispatcher.revoke`: `LeaseRevoked`). A sample
    task gives way to training in `Dispatcher._preempt_samples`. A message under a lease that
    is no longer live is refused with `Rejected` (`WorkerHandler._reject`).
"""
