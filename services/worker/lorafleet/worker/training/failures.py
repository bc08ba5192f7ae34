"""Why a training run failed, in the three classes the ledger acts on (docs/DESIGN.md,
"Failure classes").

* `NODE`: the machine is at fault (CUDA error, driver, host memory). The job is retried
  elsewhere and this machine is banned from it.
* `INPUT`: the job cannot succeed anywhere (unreadable images, impossible parameters). It fails
  at once with the message, which names what to fix.
* `INTERNAL`: anything else, and an accelerator out of memory: the scheduler granted a job that
  the node cannot hold (it sizes jobs from core/families.py), which is the scheduler's mistake,
  never the node's. Bans nobody. Nothing is guessed into the other two classes: an
  unrecognised exception is internal.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lorafleet.core.errors import InvalidArgument, LorafleetError
from lorafleet.core.model import FailureClass

# Substrings of messages raised by CUDA, its libraries and the driver (via torch's RuntimeError,
# torch.AcceleratorError or NCCL). Matched case-sensitively as the libraries spell them.
# An accelerator's allocator out of memory: the job did not fit (INTERNAL, see above).
_OUT_OF_MEMORY_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "out of memory. Tried to allocate",
)
_NODE_MESSAGES = (
    "CUDA error",
    "CUDA driver",
    "CUDA-capable device",
    "cuDNN error",
    "CUDNN_STATUS_",
    "CUBLAS_STATUS_",
    "cuBLAS error",
    "CUFFT_",
    "CUSOLVER_STATUS_",
    "NCCL",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "DefaultCPUAllocator: can't allocate memory",
)


class TrainingFailure(LorafleetError):
    """A run that must end, with the failure class the ledger needs. The message is user-facing."""

    def __init__(self, failure_class: FailureClass, message: str) -> None:
        super().__init__(message)
        self.failure_class: FailureClass = failure_class
        # Only an input fault is certain to fail again wherever it runs.
        self.retryable = failure_class is not FailureClass.INPUT


class CorruptCheckpoint(TrainingFailure):
    """Checkpoint bytes that do not verify or do not belong to this job's spec and data.

    The caller skips it and resumes from an older checkpoint (or from scratch) and reports a
    notice; it only becomes the job's failure if the caller lets it propagate.
    """

    def __init__(self, message: str) -> None:
        super().__init__(FailureClass.INTERNAL, message)


def input_fault(message: str) -> TrainingFailure:
    return TrainingFailure(FailureClass.INPUT, message)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then its causes and contexts, each once (chains can loop)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def classify_exception(exc: BaseException) -> FailureClass:
    """The failure class of any exception escaping a training run.

    An explicit `TrainingFailure` anywhere in the chain keeps its class; `InvalidArgument` (a bad
    spec) is an input fault; an accelerator out of memory is internal (the grant's mistake);
    CUDA/cuDNN/cuBLAS/NCCL/driver errors and host memory exhaustion are node faults; everything
    else is internal.
    """
    for current in _chain(exc):
        if isinstance(current, TrainingFailure):
            return current.failure_class
        if isinstance(current, InvalidArgument):
            return FailureClass.INPUT
        message = str(current)
        if isinstance(current, torch.OutOfMemoryError) or any(
            pattern in message for pattern in _OUT_OF_MEMORY_MESSAGES
        ):
            return FailureClass.INTERNAL
        if isinstance(current, (torch.AcceleratorError, MemoryError)):
            return FailureClass.NODE
        if any(pattern in message for pattern in _NODE_MESSAGES):
            return FailureClass.NODE
    return FailureClass.INTERNAL


def as_training_failure(exc: BaseException) -> TrainingFailure:
    """Wraps any exception into a `TrainingFailure` of its class, keeping it as the cause."""
    if isinstance(exc, TrainingFailure):
        return exc
    failure = TrainingFailure(classify_exception(exc), f"{type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure
