"""The `lorafleet` command."""
