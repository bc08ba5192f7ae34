"""Client commands of `lorafleet`: talk to a scheduler over gRPC, never import a service."""
