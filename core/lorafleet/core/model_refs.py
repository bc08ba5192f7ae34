"""What a job's model reference (`base_model`, `vae_model`) may look like, checked at submit.

A reference is either a Hugging Face hub id (`name` or `owner/name`) or a local diffusers folder
on the workers, named by an absolute path. A relative path (`./model`, `.lorafleet/model`,
`~/model`) is refused before any job exists: it is resolved on each worker against that worker's
own working folder (or home), so it can never name the same place the submitter sees, and a job
holding one could only fail on the fleet. Whether an absolute path or a hub id holds a model is
the worker's to check (`lorafleet.worker.training.base_model.check_model_ref`), as an input
fault.
"""

from __future__ import annotations

import re

from lorafleet.core.errors import InvalidArgument

# huggingface_hub's own rule for a repo id (less its "--" and ".." exclusions, which the hub
# then answers as a missing repository); the same pattern as the worker's check.
_HUB_ID = re.compile(r"(?:[\w.\-]{1,96}/)?[\w.\-]{1,96}")


def check_model_ref_shape(field: str, ref: str) -> None:
    """Refuses (`InvalidArgument` naming `field`) a reference that is neither an absolute path
    nor a hub id. An empty reference is left to the field's own checks."""
    if not ref or ref.startswith("/"):
        return
    relative = ref.startswith(("./", "../", "~", ".")) or "\\" in ref
    if relative:
        raise InvalidArgument(
            field,
            f"{ref[:200]!r} is a relative path: a local model must be an absolute path to a"
            " diffusers folder on the workers (each worker resolves a relative one against its"
            " own folder); a hub model is named 'owner/name'",
        )
    if ref.count("/") > 1 or not _HUB_ID.fullmatch(ref):
        raise InvalidArgument(
            field,
            f"{ref[:200]!r} is neither a hub id ('owner/name') nor an absolute path to a"
            " diffusers folder on the workers",
        )
