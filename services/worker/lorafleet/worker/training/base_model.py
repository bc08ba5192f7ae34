"""Loading a base model: which family it is, and the loaders every family shares.

Every component comes through its real `from_pretrained` (a local diffusers directory, or a hub
id downloaded into `cache_dir`), from safetensors only. The family is read from the model's own
`model_index.json` (`_class_name`: its pipeline), never guessed from its name, and checked
against the family the job was sized and keyed as (docs/DESIGN.md, "Model families"); the
family module (families/) then loads its components, and they are frozen on the run's device.
Every run, warm or cold, goes through `ResidentModel.components_for`, which makes those checks
of the job (`detect_family`, `Family.check`) whether or not it loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import diffusers as _diffusers
import torch
import transformers as _transformers

from lorafleet.core.families import PIPELINES, REFUSED_PIPELINES
from lorafleet.core.model import FailureClass
from lorafleet.core.spec import JobSpec
from lorafleet.worker.training.config import Runtime, TrainingConfig
from lorafleet.worker.training.failures import TrainingFailure, input_fault

if TYPE_CHECKING:
    from lorafleet.worker.training.families.base import Components, Family

# diffusers' and transformers' loaders and constructors are untyped or typed for their own
# generics; one Any-typed handle per package keeps the rest of this module strictly checked.
diffusers: Any = _diffusers
transformers: Any = _transformers


def load_kwargs(config: TrainingConfig) -> dict[str, Any]:
    return {"cache_dir": config.cache_dir, "local_files_only": config.local_files_only}


T = TypeVar("T")

# Weights load from safetensors only: a user names the base model, and a pickled checkpoint
# (.bin, .ckpt) can run code when loaded (docs/DESIGN.md, "Trust").
SAFE = {"use_safetensors": True}


def weights(load: Callable[[], T], ref: str, component: str, field: str = "base_model") -> T:
    """`load()`, with a model that has no safetensors weights made the job's (input) fault."""
    try:
        return load()
    except (OSError, ValueError) as exc:
        if "safetensors" in str(exc).lower():
            raise input_fault(
                f"{field}: {ref!r} has no safetensors weights for its {component}; lorafleet"
                " loads models from safetensors only, never pickled .bin or .ckpt files"
            ) from exc
        raise


# A Hugging Face hub id: `name` or `owner/name` (huggingface_hub's own rule, less its
# "--" and ".." exclusions, which the hub then answers as a missing repository).
_HUB_ID = re.compile(r"(?:[\w.\-]{1,96}/)?[\w.\-]{1,96}")


def check_model_ref(field: str, ref: str, *, component: str | None = None) -> None:
    """A model reference from the job's spec is a model folder on this worker or a hub id.

    The folder is a diffusers pipeline (its model_index.json inside), or with `component` (a
    pipeline's subfolder name, "vae") a lone component (its config.json). Anything that looks
    like a path and is not such a folder is the job's fault, with one message whether the path
    is missing, a file, or some other folder: a tenant must not learn which folders exist on a
    stranger's worker by probing. Without the check a bad path reached the hub as a malformed
    repo id and failed as an internal error three times. A pipeline folder named for a component
    is told apart, with the subfolder to name: it is a model the tenant could train as
    base_model anyway, so saying so tells nothing more."""
    marker = "model_index.json" if component is None else "config.json"
    path_like = (
        ref.startswith(("/", "./", "../", "~", "."))
        or "\\" in ref
        or ref.count("/") > 1
        or not _HUB_ID.fullmatch(ref)
    )
    path = Path(ref).expanduser()
    if not path_like and not path.exists():
        return  # a hub id
    if not (path / marker).is_file():
        if (
            component is not None
            and (path / "model_index.json").is_file()
            and (path / component / marker).is_file()
        ):
            raise input_fault(
                f"{field}: {ref!r} is a pipeline folder, not a lone {component}; name its"
                f" {component}/ subfolder ({str(path / component)!r})"
            )
        raise input_fault(
            f"{field}: {ref!r} is not a model on this worker (a local model is a diffusers"
            " folder on the worker's disk; a hub model is named 'owner/name')"
        )
    # Every component folder of a pipeline (its weights and their shard index), whatever family.
    folders = [path] if component is not None else [p for p in path.iterdir() if p.is_dir()]
    for folder in folders:
        _check_shard_index(field, ref, folder)


def _check_shard_index(field: str, ref: str, folder: Path) -> None:
    """A sharded model's index (`*.index.json`) names its shard files, and the loaders open
    whatever it names: a `.bin` shard would be unpickled even though the model is loaded with
    `use_safetensors`. Only safetensors shards beside the index are accepted."""
    for index in folder.glob("*.index.json"):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise input_fault(f"{field}: {ref!r} has an unreadable {index.name}") from exc
        for shard in shards:
            if (
                not isinstance(shard, str)
                or not shard.endswith(".safetensors")
                or Path(shard).name != shard
            ):
                raise input_fault(
                    f"{field}: {ref!r} names a shard {str(shard)[:100]!r} in {index.name};"
                    " lorafleet loads models from safetensors only, never pickled .bin or"
                    " .ckpt files"
                )


def detect_family(config: TrainingConfig) -> Family:
    """The family of the model the run loads, from its model_index.json; an input fault naming
    base_model when it is not a pipeline lorafleet trains, or not the family the job names.
    Cheap (one small JSON file, downloaded once for a hub model): made for every run, warm or
    cold."""
    from lorafleet.worker.training.families import FAMILY_OF

    ref = config.model_ref
    if config.model_path is None:  # the operator's own model path is checked at qualification
        check_model_ref("base_model", ref)
    try:
        index = diffusers.DiffusionPipeline.load_config(ref, **load_kwargs(config))
    except Exception as exc:
        raise_if_missing_repo(exc, "base_model", ref)
        raise
    pipeline = str(index.get("_class_name", ""))
    if pipeline in REFUSED_PIPELINES:
        raise input_fault(f"base_model: {ref!r} is a {pipeline}: {REFUSED_PIPELINES[pipeline]}")
    family_name = PIPELINES.get(pipeline)
    if family_name is None:
        raise input_fault(
            f"base_model: {ref!r} is a {pipeline or 'model without a pipeline class'}; lorafleet"
            f" trains {', '.join(sorted(set(PIPELINES.values())))} models"
            f" ({', '.join(sorted(PIPELINES))})"
        )
    expected = config.spec.family
    if family_name != expected:
        how = (
            "the job names it"
            if config.spec.model_family != "auto"
            else "model_family auto takes a base model the fleet does not know for sdxl"
        )
        raise input_fault(
            f"base_model: {ref!r} is a model of family {family_name} ({pipeline}) but the job was"
            f" submitted as {expected} ({how}); submit it with model_family {family_name}"
        )
    return FAMILY_OF[family_name]


def load_components(config: TrainingConfig, runtime: Runtime, family: Family) -> Components:
    """Loads every component of the model's `family` (`detect_family`'s), frozen, on the run's
    device and in its dtypes (a quantized denoiser in its quantization). What only the job
    decides (`Family.check`) is checked by the caller, on every run: not here, where a warm run
    never comes."""
    # The worker logs structured JSON; progress bars on stderr are noise there.
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    if config.vae_path is None and config.spec.vae_model:
        check_model_ref("vae_model", config.spec.vae_model, component="vae")
    components = family.load(config, runtime)
    for module in (components.denoiser, components.vae, *components.text_encoders.values()):
        module.requires_grad_(False)
        if getattr(module, "is_quantized", False):
            continue  # placed on the device by its quantizer, which refuses .to()
        # Dtypes were set while loading (casting afterwards skips modules a model keeps fp32).
        module.to(runtime.device)
    components.vae.eval()
    return components


def load_vae(config: TrainingConfig, frozen: torch.dtype, vae_class: Any) -> Any:
    """The base model's VAE (or the job's separate one), fp32 where its config says fp16
    overflows (`force_upcast`, as SDXL's)."""
    common = load_kwargs(config)
    ref, subfolder = (config.model_ref, "vae") if config.vae_ref is None else (config.vae_ref, None)
    field = config.vae_field
    try:
        vae_config = vae_class.load_config(ref, subfolder=subfolder, **common)
    except Exception as exc:
        raise_if_missing_repo(exc, field, ref)
        raise
    named = vae_config.get("_class_name")
    if named is not None and named != vae_class.__name__:
        raise input_fault(
            f"{field}: {ref!r} holds an {named}; this model's family needs an"
            f" {vae_class.__name__} (a VAE of the same family)"
        )
    dtype = frozen
    if frozen == torch.float16 and vae_config.get("force_upcast", True):
        dtype = torch.float32
    return weights(
        lambda: vae_class.from_pretrained(
            ref, subfolder=subfolder, torch_dtype=dtype, **SAFE, **common
        ),
        ref,
        "vae",
        field,
    )


def load_denoiser(
    config: TrainingConfig, runtime: Runtime, model_class: Any, subfolder: str
) -> Any:
    """The family's frozen UNet or transformer in the frozen dtype, quantized as the job asks."""
    ref = config.model_ref
    return weights(
        lambda: model_class.from_pretrained(
            ref,
            subfolder=subfolder,
            torch_dtype=runtime.frozen_dtype,
            **quantization_config(config.spec, runtime),
            **SAFE,
            **load_kwargs(config),
        ),
        ref,
        subfolder,
    )


def load_schedulers(config: TrainingConfig, scheduler_class: Any) -> tuple[Any, dict[str, Any]]:
    """The training noise scheduler (`scheduler_class` over the model's scheduler config) and
    that config as the model ships it, for the inference schedulers of class and validation
    images."""
    ref, common = config.model_ref, load_kwargs(config)
    noise_scheduler = scheduler_class.from_pretrained(ref, subfolder="scheduler", **common)
    sampler_config = dict(scheduler_class.load_config(ref, subfolder="scheduler", **common))
    return noise_scheduler, sampler_config


def quantization_config(spec: JobSpec, runtime: Runtime) -> dict[str, Any]:
    """`from_pretrained` arguments that load the frozen denoiser quantized: bitsandbytes NF4
    with double quantization (the QLoRA recipe) or torchao float8 weights; none otherwise.
    `resolve_runtime` has refused both on a CPU and where their library is missing."""
    if spec.base_quantization == "nf4":
        return {
            "quantization_config": diffusers.BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=runtime.compute_dtype,
            )
        }
    if spec.base_quantization == "fp8":
        return {"quantization_config": diffusers.TorchAoConfig("float8_weight_only")}
    return {}


def raise_if_missing_repo(exc: Exception, field: str, ref: str) -> None:
    """A hub id that does not exist, or that this fleet may not read, is the job's fault;
    a machine that cannot reach the hub (no network, offline mode) is the node's, said so."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for current in (exc, exc.__cause__, exc.__context__):
        if isinstance(current, GatedRepoError):
            raise input_fault(
                f"{field}: {ref!r} is gated on the Hugging Face hub and this fleet's workers"
                " have not been granted access"
            ) from exc
        if isinstance(current, (RepositoryNotFoundError, RevisionNotFoundError)):
            raise input_fault(f"{field}: no model {ref!r} on the Hugging Face hub") from exc
        if isinstance(current, LocalEntryNotFoundError):
            raise TrainingFailure(
                FailureClass.NODE,
                f"{field}: could not download {ref!r} on this machine (no connection to the"
                " Hugging Face hub, and not in its cache)",
            ) from exc


def install_output_hooks(text_encoders: Sequence[Any]) -> None:
    """Installs now what transformers (5.x) installs on an encoder's first forward asking for
    hidden states: its output-capturing hooks. Installed inside a `torch.compile` trace, they
    break the graph (a lock, a class-level counter) and the encoders' step runs as several
    graphs; installed before, the prompt encoding traces as one. No-op on transformers without
    them."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for encoder in text_encoders:
        maybe_install_capturing_hooks(encoder)
