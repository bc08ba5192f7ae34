"""The ledger: the Postgres truth of jobs, leases, checkpoints, nodes and the scaler's decisions.

Imported by the scheduler (which writes it), the scaler (which reads the fleet from it and
records its decisions) and the app (which wires them); by nothing else (import contracts in
pyproject.toml).

* `ledger.Ledger`: one async method per named query in `sql/queries.sql`; rows in, domain values
  (`lorafleet.core.model`) out, driver errors translated into lorafleet's error tree. Import it
  and its records from `ledger`; it is composed of one mixin per titled section of queries.sql,
  in that file's order (tests/scheduler/test_ledger_sections.py), over `base`:
  * `base.LedgerBase`: the pool, `connect`/`close`, the query plumbing (`_conn`, `_fetch`,
    `_fetchrow` over `QUERIES`) and `translate_error` (`LedgerUnavailable` or `LedgerError`).
  * `records`: the values the methods take and return (`NewJob`, `LeaseRecord`, `ScalerWork`...,
    `Quarantine`) and the rows that need more than `rows.record` (`job_from_row`...).
  * `sections.api_keys` (API keys), `sections.fleet_figures` (paces and interruptions),
    `sections.jobs` (submit, read, list, cancel), `sections.leases` (the worker stream: claim,
    heartbeat, checkpoints, class images, success, failure, drain, expiry), `sections.retention`
    (checkpoints to delete, storage to sweep), `sections.machines` (machines and replicas),
    `sections.timeline` (events, leases, counts), `sections.webhooks` (the outbox),
    `sections.scaler` (nodes, paces, work, decisions), `sections.sample_tasks`.
* `rows.record`: the typed row-to-record mapping every section uses.
* `database`: where the ledger lives (a server by URL, or an embedded `pgserver`) and its
  migrations (`sql/migrations/`, ordered plain SQL) beside `sql/schema.sql`, the current schema.
"""
