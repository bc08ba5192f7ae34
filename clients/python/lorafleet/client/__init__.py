"""The Python SDK: `Client` (blocking) and `AsyncClient` over the generated JobService stubs."""

from lorafleet.client.api import AsyncClient, Client, WatchUpdate

__all__ = ["AsyncClient", "Client", "WatchUpdate"]
