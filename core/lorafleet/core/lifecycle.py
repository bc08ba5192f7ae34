"""One lifecycle for every long-lived component: `async with` starts it, leaving stops it.

    class Store(AsyncLifecycle):
        async def start(self) -> None: ...     # optional; may be called again, must be idempotent
        async def close(self) -> None: ...     # idempotent; also what a failed start() runs

`async with Store(...) as store:` calls `start()`, and `close()` on the way out, or at once when
`start()` itself raised (so a half-started component never leaks what it had opened).
"""

from __future__ import annotations

from types import TracebackType
from typing import Self


class AsyncLifecycle:
    async def start(self) -> None:
        """Opens what the component needs; the default has nothing to open."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
