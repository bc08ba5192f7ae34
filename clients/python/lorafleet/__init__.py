"""lorafleet: SDXL DreamBooth-LoRA fine-tuning on interruptible GPUs.

`lorafleet` is assembled from several source folders (clients/python, services/*); in a wheel
they are one directory, in an editable install `extend_path` joins them.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
