"""The shared core every part of lorafleet imports: errors, domain values, the job spec, the
proto conversions (serde), settings and telemetry. It imports no client, service or app.

`lorafleet` itself is a namespace package assembled from the tree's folders (core/,
clients/python/, services/*/): each layer is one subpackage, and the import contracts in
pyproject.toml say which may import which.
"""

__version__ = "0.1.0"
