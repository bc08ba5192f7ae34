"""Machines (a worker's identity and its one live stream) and scheduler replicas."""

from __future__ import annotations

from lorafleet.core.model import Machine, Qualification
from lorafleet.ledger.base import QUERIES, LedgerBase


class MachineQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Machines and replicas" section."""

    # Machines and replicas -----------------------------------------------------------------------

    async def upsert_machine(self, machine: Machine, qualification: Qualification) -> None:
        async with self._conn() as conn:
            await conn.execute(
                QUERIES["upsert_machine"],
                machine.machine_id,
                machine.provider_instance_id,
                machine.gpu_model,
                machine.vram_mb,
                machine.qualified,
                qualification.to_json(),
                machine.version,
                list(machine.families),
            )

    async def touch_machine(self, machine_id: str, session_sha256: bytes | None) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["touch_machine"], machine_id, session_sha256)

    async def expire_machines(self, silent_s: float) -> list[str]:
        """Deletes never-verified machines silent for `silent_s` that nothing names (see the
        query); returns their ids."""
        return [str(r["machine_id"]) for r in await self._fetch("expire_machines", silent_s)]

    async def claim_machine_session(
        self,
        machine_id: str,
        *,
        presented_sha256: bytes | None,
        new_sha256: bytes,
        silent_s: float,
        identity_provider: str = "",
    ) -> bool:
        """True if this stream now holds the machine id (see the query for the rule);
        `identity_provider` names who vouched for the stream's id ("": nobody)."""
        row = await self._fetchrow(
            "claim_machine_session",
            machine_id,
            presented_sha256,
            new_sha256,
            silent_s,
            identity_provider,
        )
        return row is not None

    async def release_machine_session(self, machine_id: str, session_sha256: bytes) -> None:
        """The stream holding `session_sha256` left after draining: the id is free at once."""
        await self._fetch("release_machine_session", machine_id, session_sha256)

    async def start_replica(self, replica_id: str, lease_ttl_s: float, down_after_s: float) -> int:
        """Registers a starting replica. If none was seen for `down_after_s`, every running
        lease gets at least a TTL from now. Returns how many leases were extended."""
        row = await self._fetchrow("start_replica", replica_id, lease_ttl_s, down_after_s)
        assert row is not None
        extended: int = row[0]
        return extended

    async def touch_replica(self, replica_id: str) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["touch_replica"], replica_id)

    async def attend_replica(self, replica_id: str, lease_ttl_s: float, down_after_s: float) -> int:
        """Replica `replica_id` reaches the ledger. If no replica had for `down_after_s` (the
        ledger's clock), every lease live when one last had gets at least a TTL from now: a
        lease's TTL counts only time in which its holder could have been heard. Returns how
        many job leases were extended."""
        row = await self._fetchrow("attend_replica", replica_id, lease_ttl_s, down_after_s)
        assert row is not None
        extended: int = row[0]
        return extended
