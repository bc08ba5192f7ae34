"""The `lorafleet` command."""

import os

# `up` and `demo` start worker processes while gRPC's threads run; gRPC's fork handlers are not
# needed for fork+exec and would only log that they were skipped.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
