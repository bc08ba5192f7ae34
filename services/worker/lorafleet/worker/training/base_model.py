"""Loading the base model's components, and the prompt encoding SDXL needs.

Every component comes through its real `from_pretrained` (a local diffusers directory, or a hub
id downloaded into `cache_dir`): two CLIP tokenizers, `CLIPTextModel` and
`CLIPTextModelWithProjection`, the `UNet2DConditionModel`, the `AutoencoderKL` (optionally a
separate VAE such as an fp16-safe one), and a `DDPMScheduler` read from the base model's
scheduler config. Attention runs through PyTorch SDPA in both the UNet and the text encoders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import diffusers as _diffusers
import torch
import transformers as _transformers

from lorafleet.worker.training.config import Runtime, TrainingConfig
from lorafleet.worker.training.failures import input_fault

# diffusers' and transformers' loaders and constructors are untyped or typed for their own
# generics; one Any-typed handle per package keeps the rest of this module strictly checked.
diffusers: Any = _diffusers
transformers: Any = _transformers


@dataclass(kw_only=True)
class Components:
    """The loaded model. Modules are mutable torch objects; the dataclass only groups them."""

    tokenizer: Any
    tokenizer_2: Any
    text_encoder: Any
    text_encoder_2: Any
    vae: Any
    unet: Any
    noise_scheduler: Any
    # The base model's own inference scheduler config, for class and validation images.
    sampler_config: dict[str, Any]

    @property
    def text_encoders(self) -> tuple[Any, Any]:
        return self.text_encoder, self.text_encoder_2


def _load_kwargs(config: TrainingConfig) -> dict[str, Any]:
    return {"cache_dir": config.cache_dir, "local_files_only": config.local_files_only}


T = TypeVar("T")

# Weights load from safetensors only: a user names the base model, and a pickled checkpoint
# (.bin, .ckpt) can run code when loaded (DESIGN.md, "Trust").
_SAFE = {"use_safetensors": True}


def _weights(load: Callable[[], T], field: str, ref: str, component: str) -> T:
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


# The folders of a diffusers model that hold weights, and the file each library indexes its
# shards with.
_COMPONENT_FOLDERS = ("text_encoder", "text_encoder_2", "unet", "vae")


def check_model_ref(field: str, ref: str, *, marker: str = "model_index.json") -> None:
    """A model reference from the job's spec is a model folder on this worker or a hub id.

    Anything that looks like a path and is not a model folder (`marker` inside it: a diffusers
    pipeline's model_index.json, or a lone VAE's config.json) is the job's fault, with one
    message whether the path is missing, a file, or some other folder: a tenant must not learn
    which folders exist on a stranger's worker by probing. Without the check a bad path reached
    the hub as a malformed repo id and failed as an internal error three times."""
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
        raise input_fault(
            f"{field}: {ref!r} is not a model on this worker (a local model is a diffusers"
            " folder on the worker's disk; a hub model is named 'owner/name')"
        )
    folders = [path] if marker != "model_index.json" else [path / c for c in _COMPONENT_FOLDERS]
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


def load_components(config: TrainingConfig, runtime: Runtime) -> Components:
    """Loads every component, frozen, on the run's device and in its dtypes."""
    # The worker logs structured JSON; progress bars on stderr are noise there.
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()

    ref = config.model_ref
    if config.model_path is None:  # the operator's own model path is checked at qualification
        check_model_ref("base_model", ref)
    if config.vae_path is None and config.spec.vae_model:
        check_model_ref("vae_model", config.spec.vae_model, marker="config.json")
    common = _load_kwargs(config)
    try:
        tokenizer = transformers.CLIPTokenizer.from_pretrained(ref, subfolder="tokenizer", **common)
    except Exception as exc:
        _raise_if_missing_repo(exc, "base_model", ref)
        raise
    tokenizer_2 = transformers.CLIPTokenizer.from_pretrained(ref, subfolder="tokenizer_2", **common)
    frozen = runtime.frozen_dtype
    text_kwargs = {"dtype": frozen, "attn_implementation": "sdpa", **_SAFE, **common}
    text_encoder = _weights(
        lambda: transformers.CLIPTextModel.from_pretrained(
            ref, subfolder="text_encoder", **text_kwargs
        ),
        "base_model",
        ref,
        "text_encoder",
    )
    text_encoder_2 = _weights(
        lambda: transformers.CLIPTextModelWithProjection.from_pretrained(
            ref, subfolder="text_encoder_2", **text_kwargs
        ),
        "base_model",
        ref,
        "text_encoder_2",
    )
    unet = _weights(
        lambda: diffusers.UNet2DConditionModel.from_pretrained(
            ref, subfolder="unet", torch_dtype=frozen, **_SAFE, **common
        ),
        "base_model",
        ref,
        "unet",
    )
    vae = _load_vae(config, frozen)
    noise_scheduler = diffusers.DDPMScheduler.from_pretrained(ref, subfolder="scheduler", **common)
    sampler_config = dict(diffusers.DDPMScheduler.load_config(ref, subfolder="scheduler", **common))
    for module in (text_encoder, text_encoder_2, unet, vae):
        module.requires_grad_(False)
        # Dtypes were set while loading (casting afterwards skips modules a model keeps fp32).
        module.to(runtime.device)
    vae.eval()
    return Components(
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        vae=vae,
        unet=unet,
        noise_scheduler=noise_scheduler,
        sampler_config=sampler_config,
    )


def _load_vae(config: TrainingConfig, frozen: torch.dtype) -> Any:
    common = _load_kwargs(config)
    ref, subfolder = (config.model_ref, "vae") if config.vae_ref is None else (config.vae_ref, None)
    try:
        vae_config = diffusers.AutoencoderKL.load_config(ref, subfolder=subfolder, **common)
    except Exception as exc:
        _raise_if_missing_repo(exc, "base_model" if config.vae_ref is None else "vae_model", ref)
        raise
    # SDXL's VAE overflows in fp16 (its config says `force_upcast`), so it stays fp32 then.
    dtype = frozen
    if frozen == torch.float16 and vae_config.get("force_upcast", True):
        dtype = torch.float32
    return _weights(
        lambda: diffusers.AutoencoderKL.from_pretrained(
            ref, subfolder=subfolder, torch_dtype=dtype, **_SAFE, **common
        ),
        "base_model" if config.vae_ref is None else "vae_model",
        ref,
        "vae",
    )


def _raise_if_missing_repo(exc: Exception, field: str, ref: str) -> None:
    """A hub id that does not exist is the job's fault; network trouble is not."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    for current in (exc, exc.__cause__, exc.__context__):
        if isinstance(current, (RepositoryNotFoundError, RevisionNotFoundError)):
            raise input_fault(f"{field}: no model {ref!r} on the Hugging Face hub") from exc


def tokenize(components: Components, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids for both encoders, padded to each tokenizer's full length as SDXL was trained."""
    ids = []
    for tokenizer in (components.tokenizer, components.tokenizer_2):
        ids.append(
            tokenizer(
                prompts,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
        )
    return ids[0], ids[1]


def encode_prompts(
    text_encoders: Sequence[Any], ids: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL conditioning from `Components.text_encoders`:
    penultimate hidden states of both encoders side by side, and the second encoder's projected
    pooled output. Grad flows when the encoders carry LoRA."""
    hidden = []
    pooled = None
    for encoder, token_ids in zip(text_encoders, ids, strict=True):
        out = encoder(token_ids.to(encoder.device), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        # Only the second encoder (with projection) has `text_embeds`; it is SDXL's pooled input.
        pooled = getattr(out, "text_embeds", None)
    assert pooled is not None
    return torch.cat(hidden, dim=-1), pooled


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


def sampling_pipeline(components: Components) -> Any:
    """A StableDiffusionXLPipeline over the loaded modules (no copy, LoRA included when added)
    with the base model's own inference scheduler."""
    scheduler_class = getattr(diffusers, str(components.sampler_config.get("_class_name")), None)
    if not (isinstance(scheduler_class, type) and hasattr(scheduler_class, "from_config")):
        scheduler_class = diffusers.EulerDiscreteScheduler
    pipeline = diffusers.StableDiffusionXLPipeline(
        vae=components.vae,
        text_encoder=components.text_encoder,
        text_encoder_2=components.text_encoder_2,
        tokenizer=components.tokenizer,
        tokenizer_2=components.tokenizer_2,
        unet=components.unet,
        scheduler=scheduler_class.from_config(components.sampler_config),
        add_watermarker=False,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
