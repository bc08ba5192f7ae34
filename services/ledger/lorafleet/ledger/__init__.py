"""The ledger: the Postgres truth of jobs, leases, checkpoints, nodes and the scaler's decisions.

Imported by the scheduler (which writes it), the scaler (which reads the fleet from it and
records its decisions) and the app (which wires them); by nothing else (import contracts in
pyproject.toml).

* `ledger.Ledger`: one async method per named query in `sql/queries.sql`; rows in, domain values
  (`lorafleet.core.model`) out, driver errors translated into lorafleet's error tree.
* `database`: where the ledger lives (a server by URL, or an embedded `pgserver`) and its
  migrations (`sql/migrations/`, ordered plain SQL) beside `sql/schema.sql`, the current schema.
"""
