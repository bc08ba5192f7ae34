"""Failure classes: node faults, input faults, and nothing guessed."""

from __future__ import annotations

import pytest
import torch

from lorafleet.core.errors import InvalidArgument, LorafleetError
from lorafleet.core.model import FailureClass
from lorafleet.worker.training import CorruptCheckpoint, TrainingFailure, classify_exception
from lorafleet.worker.training.failures import as_training_failure


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1269, unhandled system error"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError(
            "Found no NVIDIA driver on your system... CUDA driver version is insufficient"
        ),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        ),
        MemoryError(),
    ],
)
def test_node_faults(exc: BaseException) -> None:
    assert classify_exception(exc) == FailureClass.NODE


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("CUDA error: out of memory"),
    ],
)
def test_an_accelerator_out_of_memory_is_the_grants_mistake_not_the_nodes(
    exc: BaseException,
) -> None:
    """The scheduler sized the job for this node (core/families.py): it did not fit, which
    says nothing against the machine, so it is never a node fault that bans it."""
    assert classify_exception(exc) == FailureClass.INTERNAL


def test_node_fault_found_through_the_cause_chain() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: unspecified launch failure")
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        assert classify_exception(outer) == FailureClass.NODE


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("shapes do not match"),
        KeyError("unet"),
        RuntimeError("expected scalar type Float but found Half"),
        OSError("No such file or directory"),
    ],
)
def test_everything_else_is_internal(exc: BaseException) -> None:
    assert classify_exception(exc) == FailureClass.INTERNAL


def test_explicit_classes_win() -> None:
    assert (
        classify_exception(TrainingFailure(FailureClass.INPUT, "resolution: too big"))
        == FailureClass.INPUT
    )
    assert (
        classify_exception(InvalidArgument("resolution", "must be a multiple of 8"))
        == FailureClass.INPUT
    )
    assert classify_exception(CorruptCheckpoint("digest mismatch")) == FailureClass.INTERNAL


def test_training_failure_is_a_lorafleet_error_with_retryability() -> None:
    assert issubclass(TrainingFailure, LorafleetError)
    assert TrainingFailure(FailureClass.INPUT, "x").retryable is False
    assert TrainingFailure(FailureClass.NODE, "x").retryable is True
    assert TrainingFailure(FailureClass.INTERNAL, "x").retryable is True


def test_wrapping_keeps_the_cause() -> None:
    original = RuntimeError("CUDA error: misaligned address")
    wrapped = as_training_failure(original)
    assert wrapped.failure_class == FailureClass.NODE
    assert wrapped.__cause__ is original
    assert "RuntimeError: CUDA error" in str(wrapped)
    same = TrainingFailure(FailureClass.INPUT, "bad")
    assert as_training_failure(same) is same


def test_chain_cycles_terminate() -> None:
    a = ValueError("a")
    b = ValueError("b")
    a.__context__ = b
    b.__context__ = a
    assert classify_exception(a) == FailureClass.INTERNAL
