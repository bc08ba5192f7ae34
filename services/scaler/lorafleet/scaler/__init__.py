"""The scaler: keeps the fleet the right size and healthy through a provider's API.

* `provider.Provider` is the interface every provider implements, three of them here:
  `local.LocalProcessProvider` (worker processes on this machine, for `lorafleet up` and
  `lorafleet demo`), `salad.SaladProvider` (a SaladCloud container group) and
  `ec2.Ec2SpotProvider` (EC2 spot instances); `service.provider_from_settings` picks one.
* `policy.decide` is the rule, pure: a snapshot of the fleet in, decisions with their reasons
  out (docs/DESIGN.md, "The scaler's view").
* `service.Scaler` is the loop: one active scaler by a Postgres advisory lock, a snapshot from
  the provider and the ledger each tick, the decisions recorded in the ledger and carried out
  (`actions.apply` on the provider; a DROP_LEASE in the ledger).
"""
