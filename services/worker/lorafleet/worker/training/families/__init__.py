"""The model families the trainer knows, one module each (base.py says what a family is).

`FAMILY_OF` maps the core's family names (lorafleet.core.families) to their trainer; the
worker announces them as the families it serves. To add one: a module beside these with its
`Family` subclass, its entry here and in core/families.py (pipeline, variants, memory), a tiny
builder in worker/tiny_model.py, and its tests (tests/worker/test_families.py runs every family
through the same checks).
"""

from __future__ import annotations

from lorafleet.core.families import FamilyName
from lorafleet.worker.training.families.base import Components, Family
from lorafleet.worker.training.families.flux import Flux
from lorafleet.worker.training.families.flux2 import Flux2
from lorafleet.worker.training.families.sdxl import Sdxl

FAMILY_OF: dict[FamilyName, Family] = {"sdxl": Sdxl(), "flux": Flux(), "flux2": Flux2()}

__all__ = ["FAMILY_OF", "Components", "Family"]
