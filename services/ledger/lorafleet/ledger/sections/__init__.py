"""The sections of `Ledger`, one mixin each, in queries.sql's order (see `lorafleet.ledger`)."""
