"""One exception tree for lorafleet, translated to gRPC status codes at the servicer edge.

Each error says whether retrying the same call can help (`retryable`).
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class LorafleetError(Exception):
    """Root of every error lorafleet raises on purpose."""

    retryable: bool = False


class InvalidArgument(LorafleetError):
    """A request field is malformed; `field` names it (dotted path), `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(LorafleetError):
    """The thing does not exist, or belongs to another owner (the two are indistinguishable)."""


class Unauthenticated(LorafleetError):
    """Missing or unknown credentials."""


class FailedPrecondition(LorafleetError):
    """The request is well-formed but the state forbids it (e.g. artifacts of a queued job)."""


class AlreadyExists(LorafleetError):
    """The thing is held by someone else (e.g. a machine id by another live worker stream)."""


class ResourceExhausted(LorafleetError):
    """A caller went past a bound (message rate, unread replies); it may come back later."""

    retryable = True


class StaleLease(LorafleetError):
    """A worker message named a lease that is no longer the job's (the fencing token failed)."""


class StorageError(LorafleetError):
    """Object storage failed; transient network trouble is retryable."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class LedgerUnavailable(LorafleetError):
    """The database could not be reached; the caller may retry."""

    retryable = True


def is_retryable(exc: BaseException) -> bool:
    """Whether `exc` is one of lorafleet's errors that a retry may cure (e.g. the ledger or the
    store was unavailable). Background loops outlive these and stop on anything else."""
    return isinstance(exc, LorafleetError) and exc.retryable


class OneLineErrorParser(argparse.ArgumentParser):
    """Every `lorafleet` command's parser (`lorafleet worker`'s, and through add_subparsers,
    which makes subparsers of its own class, every subcommand's): a bad flag is one line and
    where to read more, as any other error. argparse's own printed the usage first, 54 lines
    of it for `submit`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help`\n")
