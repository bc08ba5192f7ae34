"""Carrying out the policy's decisions on a provider (the loop of phase B calls this).

`DROP_LEASE` is the ledger's to carry out (re-queue the job from its checkpoint, ban the
machine for it), and `HOLD` is a record only: `apply` returns False for both, True when the
provider was called.
"""

from __future__ import annotations

from lorafleet.scaler.policy import Action, Decision
from lorafleet.scaler.provider import Provider, StillWanted


async def apply(
    provider: Provider, decision: Decision, *, still_wanted: StillWanted | None = None
) -> bool:
    """`still_wanted`: asked before each retry of a scale (see `Provider.scale_to`)."""
    match decision.action:
        case Action.SCALE:
            assert decision.replicas is not None
            await provider.scale_to(
                decision.replicas, remove=decision.remove, still_wanted=still_wanted
            )
        case Action.REALLOCATE:
            await provider.reallocate(decision.target)
        case Action.RESTART:
            await provider.restart(decision.target)
        case Action.SET_DELETION_COST:
            assert decision.deletion_cost is not None
            await provider.set_deletion_cost(decision.target, decision.deletion_cost)
        case Action.DROP_LEASE | Action.HOLD:
            return False
    return True
