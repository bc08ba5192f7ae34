"""The worker: connects to the scheduler, trains leased jobs in-process, checkpoints from memory.

* `main` (and `__main__`): `lorafleet worker`; `config.WorkerConfig`, its options; signals drain.
* `agent.Agent`: the process's one long-lived component: its state machine (`State`), what each
  message from the scheduler does, its leases, the drain, its lifecycle. `Agent` inherits:
  * `stream.SchedulerStream`: the transport, one Connect stream at a time (`Session`): the
    channel, Hello (with `identity`'s proof) and Welcome, heartbeats, pings, the silence bound.
  * `metadata_services.MetadataServices`: what the provider's metadata service says: EC2's spot
    notice drains (`spot_notice`); a failed probe on SaladCloud asks for another node
    (`salad_imds`).
* `qualify`: the probe a worker runs once, before its first lease.
* One lease: `lease_runner.LeaseRunner` (a training lease) or `sample_runner.SampleRunner` (a
  sample task), over `lease` (what they share), `lease_inputs`, `uploads`, `setup_watch` and
  `auto_interval`; `transfer` moves bytes through signed URLs; `training_thread` is where runs
  train.
* `training`: the trainer (no gRPC: import contracts in pyproject.toml); `simulated`: a trainer
  that fakes only the arithmetic; `tiny_model`, `tiny_models`: random stand-in models.
* `metrics`: the worker's Prometheus metrics.
"""
