"""What `submit` does with local inputs before anything is sent: reading and checking the
training images (a folder, a zip, or a zip at a URL), naming their upload prefix, and taking a
local base model's family from its model_index.json.

Apart from the commands because it reads this machine's files (and says on stderr what it
skipped), where the commands only talk to the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from lorafleet.cli.spec_flags import named_family
from lorafleet.client import AsyncClient
from lorafleet.client.dataset import (
    IMAGE_SUFFIXES,
    TrainingFile,
    fetch_zip,
    read_folder,
    read_zip,
)
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import DEFAULT_FAMILY, PIPELINES, REFUSED_PIPELINES


async def read_images(
    client: AsyncClient, *, folder: str | None, zip_file: str | None, url: str | None
) -> list[TrainingFile]:
    """The checked files of whichever of --images, --images-zip, --images-url was given."""
    skipped: list[str] = []
    if folder:
        files = await asyncio.to_thread(read_folder, folder, skipped=skipped)
        say_skipped(folder, skipped)
        return files
    if zip_file:
        files = await asyncio.to_thread(read_zip, zip_file, skipped=skipped)
        say_skipped(zip_file, skipped)
        return files
    assert url
    data = await fetch_zip(url, allow_http_loopback=_allow_http_loopback())
    files = await asyncio.to_thread(read_zip, data, field="images_url", name=url, skipped=skipped)
    say_skipped(url, skipped)
    return files


def say_skipped(source: str, skipped: list[str]) -> None:
    """One line on stderr naming the files left out (neither an image nor a caption), so a
    `notes.pdf` among the photos is never dropped in silence; stdout stays the command's
    output (`--json`)."""
    if not skipped:
        return
    names = ", ".join(skipped[:10]) + (
        f" (and {len(skipped) - 10} more)" if len(skipped) > 10 else ""
    )
    kinds = ", ".join(IMAGE_SUFFIXES)
    print(
        f"note: skipped {len(skipped)} file(s) in {source} that are neither images ({kinds})"
        f" nor .txt captions: {names}",
        file=sys.stderr,
    )


def _allow_http_loopback() -> bool:
    # Testing only: lets --images-url fetch plain http from a loopback address.
    return os.environ.get("LORAFLEET_ALLOW_HTTP_LOOPBACK_URLS", "") == "1"


def family_from_local_model(spec: dict[str, Any], *, where: str = "") -> str | None:
    """With `model_family` auto, a `base_model` folder that is on this machine (as on `lorafleet
    up`, where the workers read the same folder) names its own family in its model_index.json:
    the spec takes it. Otherwise the scheduler would take an unknown local model for sdxl and
    the worker fail the job once it loaded it. A family named that the folder contradicts, a
    pipeline lorafleet does not train or refuses, an unreadable model_index.json, or a file or
    a folder without model_index.json at that path is refused here, naming base_model, before
    anything is uploaded.
    Returns a note for the user when it filled the family in."""
    base_model = str(spec.get("base_model") or "")
    index = Path(base_model) / "model_index.json"
    if base_model and not os.path.isabs(base_model) and index.is_file():
        # `--base-model flux` beside a folder `flux` was taken for a hub id and failed on the
        # worker: a model folder here is meant, and it needs its absolute path.
        raise InvalidArgument(
            f"{where}base_model",
            f"{base_model!r} is a model folder here, but the workers need its absolute path"
            f" (a relative one reads as a hub id): {Path(base_model).resolve()}",
        )
    if not os.path.isabs(base_model) or not os.path.exists(base_model):
        return None  # a hub id, or a folder only the workers have: the worker checks it
    field = f"{where}base_model"
    # Something here at that path that is no pipeline folder would be uploaded as a job that
    # could only fail on the worker, once it loaded the model.
    if not os.path.isdir(base_model):
        folder = Path(base_model).parent
        raise InvalidArgument(
            field,
            f"{base_model!r} is a file: a local model is a diffusers pipeline folder"
            + (f" ({folder}?)" if (folder / "model_index.json").is_file() else ""),
        )
    if not index.is_file():
        raise InvalidArgument(
            field,
            f"{base_model!r} holds no model_index.json: a local model is a diffusers pipeline"
            " folder",
        )
    try:
        document = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise InvalidArgument(
            field, f"{base_model!r} has an unreadable {index.name}: {reason}"
        ) from None
    named_pipeline = document.get("_class_name") if isinstance(document, dict) else None
    pipeline = str(named_pipeline or "")
    # The one table of pipelines the worker checks the model against (core/families.py).
    if pipeline in REFUSED_PIPELINES:
        raise InvalidArgument(
            field, f"{base_model!r} is a {pipeline}: {REFUSED_PIPELINES[pipeline]}"
        )
    family = PIPELINES.get(pipeline)
    if family is None:
        raise InvalidArgument(
            field,
            f"{base_model!r} is a {pipeline or 'model without a pipeline class'}; lorafleet"
            f" trains {', '.join(sorted(set(PIPELINES.values())))} models"
            f" ({', '.join(sorted(PIPELINES))})",
        )
    named = named_family(spec, where=where)
    if named == "auto" and family == DEFAULT_FAMILY:
        return None  # what auto takes it for already
    if named == "auto":
        spec["model_family"] = family
        return (
            f"note: {base_model} is a model of family {family} ({pipeline}): model_family {family}"
        )
    if named != family:
        raise InvalidArgument(
            field,
            f"{base_model!r} is a model of family {family} ({pipeline}) but model_family says"
            f" {named}; submit it with model_family {family}",
        )
    return None


def image_source(
    folder: str | None, zip_file: str | None, url: str | None, *, where: str = ""
) -> str | None:
    """The name the upload prefix is derived from; refuses more than one source."""
    given = [s for s in (folder, zip_file, url) if s]
    if len(given) > 1:
        raise InvalidArgument(
            f"{where}images", "give only one of --images, --images-zip, --images-url"
        )
    if not given:
        return None
    name = given[0].rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    return name.removesuffix(".zip") or "images"


def upload_prefix(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return f"{safe.strip('.') or 'images'}-{uuid.uuid4().hex[:8]}"
