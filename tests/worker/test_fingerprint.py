"""The resume fingerprint is pinned: a change that would stop old checkpoints resuming fails here.

A checkpoint resumes only while the fingerprint of the spec and data it was trained on is the
same. The values below were computed before the spec fields were declared with metadata; if one
of them changes, every checkpoint in the world written with such a spec stops resuming. A new
spec field must not change them at its default (declare it with a later `since`); a field that
does not change the trained weights must not change them at all (`trains=False`).
"""

from __future__ import annotations

import dataclasses

import torch

from lorafleet.core.spec import SPEC_FIELDS, SPEC_REVISION, JobSpec
from lorafleet.worker.simulated import simulated_fingerprint
from lorafleet.worker.training.data import PreparedImage, TrainingImage
from lorafleet.worker.training.loop import job_fingerprint


def _image(name: str, sha256: str, caption: str | None) -> PreparedImage:
    return PreparedImage(
        name=name, pixels=torch.zeros(1), original_size=(8, 8), caption=caption, sha256=sha256
    )


INSTANCE = [_image("a.png", "aa" * 32, "a photo"), _image("b.png", "bb" * 32, None)]
CLASS = [_image("c.png", "cc" * 32, None)]
RAW = [TrainingImage(name="a.png", data=b"abc", caption="a photo")]
BASE = JobSpec(instance_prompt="a photo of sks dog", instance_data_prefix="rex", max_train_steps=50)
# Fields of every kind away from their defaults: first-format ones, later ones, and some that
# do not train (which must not count).
CHANGED = dataclasses.replace(
    BASE,
    class_prompt="a dog",
    with_prior_preservation=True,
    learning_rate=3e-4,
    train_text_encoder=True,
    lr_scheduler="cosine",
    lr_warmup_steps=3,
    train_batch_size=2,
    mixed_precision="bf16",
    resolution=512,
    lora_rank=8,
    lora_alpha=16.0,
    snr_gamma=5.0,
    seed=7,
    adam_beta1=0.8,
    optimizer="prodigy",
    prodigy_d_coef=0.5,
    use_dora=True,
    lora_dropout=0.1,
    repeats=3,
    aspect_ratio_bucketing=True,
    checkpointing_steps=10,
    priority=3,
    labels={"t": "x"},
    validation_prompts=("v",),
)


def test_the_fingerprint_of_a_default_spec_is_pinned() -> None:
    assert job_fingerprint(BASE, INSTANCE, CLASS) == (
        "c31ce5c27b8eab6c122a3235a38b092f149f5e7b2a0a32847bf7648a247a78a3"
    )


def test_the_fingerprint_of_a_spec_with_every_kind_of_field_set_is_pinned() -> None:
    assert job_fingerprint(CHANGED, INSTANCE, CLASS) == (
        "ab181a1e4a6b76e1fc3b9181cb12b5027d88b9973129ae7029b73eb6d70c6d31"
    )


def test_the_simulated_trainers_fingerprints_are_pinned() -> None:
    assert simulated_fingerprint(BASE, RAW) == (
        "2a12af83d3bab887523beec36e0aa04ab29a4d281817b41a07b357de56a1aeac"
    )
    assert simulated_fingerprint(CHANGED, RAW) == (
        "b251085888dcd98fd6420fcf8fc34706b576a520ab6ed64544d00f30d92b4ab3"
    )


def test_fields_that_do_not_train_leave_the_fingerprint_alone() -> None:
    other = dataclasses.replace(
        BASE,
        instance_data_prefix="elsewhere",
        checkpointing_steps=7,
        validation_prompt="a dog on the moon",
        validation_steps=5,
        priority=-3,
        max_failures=9,
        output_format="kohya",
        labels={"team": "a"},
        webhook_url="https://example.com/hook",
    )
    assert job_fingerprint(other, INSTANCE, CLASS) == job_fingerprint(BASE, INSTANCE, CLASS)


def test_a_field_that_trains_changes_the_fingerprint() -> None:
    for changes in (
        {"learning_rate": 2e-4},
        {"seed": 1},
        {"repeats": 2},
        {"use_dora": True},
        {"scale_lr": True},
    ):
        other = dataclasses.replace(BASE, **changes)
        assert job_fingerprint(other, INSTANCE, CLASS) != job_fingerprint(BASE, INSTANCE, CLASS)


def test_a_new_field_at_its_default_leaves_old_fingerprints_alone() -> None:
    """Fields that train and came after the first revision count only away from their default:
    the fingerprint of a spec that leaves them all at their defaults has none of them."""
    assert max(f.since for f in SPEC_FIELDS) == SPEC_REVISION
    later = {f.name for f in SPEC_FIELDS if f.trains and f.since > 1}
    assert later and not later & set(BASE.fingerprint_values())
    assert {f.name for f in SPEC_FIELDS if f.trains and f.since <= 2} == set(
        BASE.fingerprint_values(first_revision=2)
    )
