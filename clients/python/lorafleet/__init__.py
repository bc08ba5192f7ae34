"""lorafleet: SDXL DreamBooth-LoRA fine-tuning on interruptible GPUs.

`lorafleet` is assembled from several source folders (clients/python, services/*); in a wheel
they are one directory, in an editable install `extend_path` joins them.
"""

from pkgutil import extend_path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.client import AsyncClient, Client

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "__version__"]


def __getattr__(name: str) -> object:
    # `lorafleet.Client` without importing grpc for every `import lorafleet.<service>`.
    if name in ("Client", "AsyncClient"):
        from lorafleet import client

        return getattr(client, name)
    raise AttributeError(name)
