"""LoRA adapters (peft) on the family's denoiser and optionally its trainable text encoders,
and the result files.

The result is `pytorch_lora_weights.safetensors` as the family's pipeline `save_lora_weights`
writes it (keys prefixed by pipeline name: `unet.`/`transformer.`, `text_encoder.`, ...; the
key style is the family's), fp32 tensors, and the adapters' LoRA configs in the
`lora_adapter_metadata` header entry, so `load_lora_weights` restores `lora_alpha` (the scale)
and not only the rank. The kohya file takes the family's ComfyUI layout. Both are built in
memory: the diffusers helpers write to a directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.training_utils import cast_training_params
from diffusers.utils import peft_utils as _peft_utils
from diffusers.utils import state_dict_utils as _state_dict_utils
from peft import LoraConfig as _LoraConfig
from peft.tuners.lora.dora import DoraLinearLayer as _DoraLinearLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict

from lorafleet.worker.training.families.base import Components, Family
from lorafleet.worker.training.serialization import safetensors_bytes

# Untyped in diffusers; peft types lora_alpha as int though it is a float scale numerator.
convert_state_dict_to_diffusers: Any = _state_dict_utils.convert_state_dict_to_diffusers
convert_state_dict_to_kohya: Any = _state_dict_utils.convert_state_dict_to_kohya
recurse_remove_peft_layers: Any = _peft_utils.recurse_remove_peft_layers
DoraLinearLayer: Any = _DoraLinearLayer
LoraConfig: Any = _LoraConfig

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"
# diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
_ADAPTER_METADATA_KEY = "lora_adapter_metadata"


# peft's name for the one adapter each module carries.
_ADAPTER = "default"
# The `_config` arguments a module's adapters were injected with (a private module attribute).
_SHAPE_ATTRIBUTE = "_lorafleet_adapter_shape"
# The parked adapters of another shape a module keeps aside (`_Shelved`, or None).
_SHELF_ATTRIBUTE = "_lorafleet_shelved_adapters"


def add_lora(
    components: Components,
    *,
    rank: int,
    alpha: float,
    train_text_encoder: bool,
    use_dora: bool = False,
    dropout: float = 0.0,
) -> dict[str, Any]:
    """Adds adapters and returns the trained modules by their pipeline name, denoiser first
    (the family's targets; text encoders only those the family lets train).

    LoRA parameters are kept in fp32 whatever the frozen weights' dtype, so small updates are
    not rounded away; the base weights stay frozen. `use_dora` makes them DoRA adapters (a
    trained magnitude vector per layer beside the low-rank direction update); `dropout` drops
    the adapters' input during training (torch's default generator: the run's own stream).
    Initialisation draws from torch's default generator: call this inside the run's stream.

    A module that carries adapters parked by `park_lora` with the same arguments (targets,
    rank, alpha, DoRA, dropout) keeps them: they are re-initialised in place
    (`_reinitialise`), drawing exactly what a fresh injection draws, in its order, so they
    hold the same bits and leave the generator in the same state. Parked adapters of another
    shape are taken off and kept aside, one set per module (`_Shelved`: two job shapes
    alternating on a worker both stay warm); the set kept aside is put back when it has the
    shape asked for, else fresh adapters are injected. Either way the run starts from what it
    would on a freshly loaded model.
    """
    family = components.family
    modules = components.modules
    targets = {family.denoiser_name: family.denoiser_targets(components.denoiser)}
    if train_text_encoder:
        targets |= {name: family.encoder_targets(name) for name in family.trainable_encoders}
    trained: dict[str, Any] = {}
    # The order of a fresh injection: the denoiser, then the encoders.
    for name, module in modules.items():
        shape = (rank, alpha, targets[name], use_dora, dropout) if name in targets else None
        if (
            shape is not None
            and getattr(module, _SHAPE_ATTRIBUTE, None) == shape
            and _parked(module)
        ):
            _reinitialise(module, rank=rank, use_dora=use_dora)
            trained[name] = module
            continue
        shelved: _Shelved | None = getattr(module, _SHELF_ATTRIBUTE, None)
        put_back = shelved is not None and shape is not None and shelved.shape == shape
        taken = _take_off(module)
        if taken is not None or put_back:
            setattr(module, _SHELF_ATTRIBUTE, taken)
        if shape is None:
            continue
        if put_back:
            assert shelved is not None
            shelved.put_back(module)
            _reinitialise(module, rank=rank, use_dora=use_dora)
        else:
            module.add_adapter(
                _config(rank, alpha, targets[name], use_dora=use_dora, dropout=dropout)
            )
            setattr(module, _SHAPE_ATTRIBUTE, shape)
        trained[name] = module
    cast_training_params(list(trained.values()), dtype=torch.float32)
    return trained


def park_lora(components: Components) -> None:
    """After a run: every adapter is zeroed, its gradients dropped, frozen and disabled, so
    nothing of the run's weights is kept and the modules compute exactly what the base model
    computes (a disabled peft layer calls its base layer alone), until the next run of the
    same shape re-initialises them (`add_lora`) or one of another shape takes them off."""
    for module in components.modules.values():
        for layer in _lora_layers(module):
            with torch.no_grad():
                for param in _adapter_parameters(layer):
                    param.grad = None
                    param.zero_()
            layer.enable_adapters(False)  # also freezes them
            layer._caches.clear()
            layer.cast_input_dtype_enabled = True
        trainable = [name for name, p in module.named_parameters() if p.requires_grad]
        if trainable:
            raise RuntimeError(
                f"trainable weights left on {type(module).__name__}: {trainable[:3]}"
            )


def parked_shapes(components: Components) -> list[tuple[int, float, bool, bool, float]]:
    """What the next run can take warm (`add_lora` re-initialises or puts back instead of
    injecting): each adapter shape the denoiser holds parked, attached or kept aside, as (rank,
    alpha, train_text_encoder, use_dora, dropout); with text-encoder training too where every
    trainable encoder holds that shape. Call it after `park_lora`, on the training thread."""

    def held(module: Any) -> list[tuple[Any, ...]]:
        shapes = []
        current = getattr(module, _SHAPE_ATTRIBUTE, None)
        if current is not None and _parked(module):
            shapes.append(current)
        shelved: _Shelved | None = getattr(module, _SHELF_ATTRIBUTE, None)
        if shelved is not None:
            shapes.append(shelved.shape)
        return shapes

    family = components.family
    names = family.trainable_encoders
    encoders = {name: held(components.text_encoders[name]) for name in names}
    warm: list[tuple[int, float, bool, bool, float]] = []
    for rank, alpha, _, use_dora, dropout in held(components.denoiser):
        warm.append((rank, alpha, False, use_dora, dropout))
        if names and all(
            (rank, alpha, family.encoder_targets(name), use_dora, dropout) in encoders[name]
            for name in names
        ):
            warm.append((rank, alpha, True, use_dora, dropout))
    return warm


def skip_input_casts(modules: Iterable[Any]) -> None:
    """The LoRA layers of `modules` stop casting their input to the adapter weights' dtype:
    under autocast it casts straight back. peft casts by default (needed without autocast when
    the frozen weights are in another dtype); `park_lora` restores that for the next run."""
    for module in modules:
        for layer in _lora_layers(module):
            layer.cast_input_dtype_enabled = False


def _remove_adapters(module: Any) -> None:
    """Each LoRA layer is replaced by the base layer it wrapped (never merged: the base weights
    are untouched) and peft's bookkeeping goes with it, so the module is again the one
    `load_components` made. Raises RuntimeError if anything of an adapter is left (the caller
    drops the model then)."""
    if not hasattr(module, _SHAPE_ATTRIBUTE) and not hasattr(module, "peft_config"):
        return
    recurse_remove_peft_layers(module)
    for attribute in ("peft_config", _SHAPE_ATTRIBUTE):
        if hasattr(module, attribute):
            delattr(module, attribute)
    if hasattr(module, "_hf_peft_config_loaded"):
        module._hf_peft_config_loaded = False
    left = [name for name, m in module.named_modules() if isinstance(m, BaseTunerLayer)]
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    if left or trainable:
        raise RuntimeError(f"adapters left on {type(module).__name__}: {(left + trainable)[:3]}")


@dataclass(frozen=True)
class _Shelved:
    """Parked adapters taken off a module and kept aside: each LoRA layer with the parent and
    name it was attached under, and the module's peft bookkeeping."""

    shape: tuple[Any, ...]
    layers: list[tuple[Any, str, Any]]
    peft_config: dict[str, Any]

    def put_back(self, module: Any) -> None:
        for parent, name, layer in self.layers:
            setattr(parent, name, layer)
        module.peft_config = self.peft_config
        module._hf_peft_config_loaded = True
        setattr(module, _SHAPE_ATTRIBUTE, self.shape)


def _take_off(module: Any) -> _Shelved | None:
    """Takes the module's adapters off: parked ones are returned to be kept aside (each layer's
    place gets its base layer back, as peft's own removal does); any others are dropped."""
    shape = getattr(module, _SHAPE_ATTRIBUTE, None)
    if shape is None or not _parked(module):
        _remove_adapters(module)
        return None
    layers = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, LoraLayer)
    ]
    shelved = _Shelved(shape=shape, layers=layers, peft_config=module.peft_config)
    for parent, name, layer in layers:
        setattr(parent, name, layer.get_base_layer())
    _remove_adapters(module)  # the bookkeeping; checks that nothing is left
    return shelved


def _lora_layers(module: Any) -> list[Any]:
    """The module's LoRA layers in module order, which is the order peft injected them in (a
    wrapper takes the place of the layer it wraps)."""
    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def _adapter_parameters(layer: Any) -> list[torch.nn.Parameter]:
    return [
        param
        for attribute in layer.adapter_layer_names
        for param in getattr(layer, attribute).parameters()
    ]


def _parked(module: Any) -> bool:
    """Adapters `park_lora` left: plain LoRA linear layers with the one adapter, disabled."""
    layers = _lora_layers(module)
    return bool(layers) and all(
        isinstance(layer, LoraLinear)
        and layer.disable_adapters
        and not layer.merged
        and set(layer.lora_A) == {_ADAPTER}
        and not layer.lora_bias[_ADAPTER]
        for layer in layers
    )


def _reinitialise(module: Any, *, rank: int, use_dora: bool) -> None:
    """Gives the module's parked adapters the values a fresh injection (peft's
    `LoraLayer.update_layer`, layer by layer in module order) would give them, from the same
    draws of torch's default generator in the same order: per layer, nn.Linear's constructor
    for lora_A and for lora_B (kaiming-uniform draws each, on the default device and dtype),
    then the "gaussian" reset of A (a normal draw; B zeros), cast to the base layer's device
    and dtype; DoRA's magnitude is computed by peft's own code from those tensors. Then the
    adapters are enabled and trainable again."""
    with torch.no_grad():
        for layer in _lora_layers(module):
            base = layer.get_base_layer()
            device, dtype = layer._get_base_layer_device_and_dtype(base)
            fresh_a = torch.nn.Linear(layer.in_features, rank, bias=False)
            torch.nn.Linear(rank, layer.out_features, bias=False)  # its draws; B becomes zeros
            torch.nn.init.normal_(fresh_a.weight, std=1 / layer.r[_ADAPTER])
            weight_a = fresh_a.weight.to(device, dtype)
            layer.lora_A[_ADAPTER].weight.copy_(weight_a)
            layer.lora_B[_ADAPTER].weight.zero_()
            if use_dora:
                magnitude = DoraLinearLayer(fan_in_fan_out=layer.fan_in_fan_out)
                magnitude.update_layer(
                    base_layer=base,
                    lora_A=weight_a,
                    lora_B=torch.zeros(layer.out_features, rank, device=device, dtype=dtype),
                    scaling=layer.scaling[_ADAPTER],
                )
                layer.lora_magnitude_vector[_ADAPTER].weight.copy_(magnitude.weight)
            layer.enable_adapters(True)


def _config(
    rank: int, alpha: float, targets: tuple[str, ...], *, use_dora: bool, dropout: float
) -> Any:
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_dora=use_dora,
        lora_dropout=dropout,
        # Gaussian A with zero B: the adapter starts as an exact no-op, as in diffusers' scripts.
        init_lora_weights="gaussian",
        target_modules=list(targets),
    )


def lora_parameters(module: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable (LoRA) parameters of a module, in registration order (stable across runs)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _peft_states(trained: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Each trained module's peft LoRA tensors (fp32, on the host), by pipeline name."""
    return {
        # save_embedding_layers=False: no embedding is trained, and the "auto" check tries to
        # read the base model's config from disk (and warns) for text encoders.
        name: {
            key: tensor.detach().to("cpu", torch.float32).contiguous()
            for key, tensor in get_peft_model_state_dict(
                module, save_embedding_layers=False
            ).items()
        }
        for name, module in trained.items()
    }


def lora_state_dict(family: Family, trained: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The result file's tensors: the family's diffusers layout of every trained module."""
    return family.diffusers_state_dict(_peft_states(trained))


def lora_weights_bytes(family: Family, trained: Mapping[str, Any]) -> bytes:
    """The finished LoRA as `pytorch_lora_weights.safetensors` bytes."""
    adapter_metadata: dict[str, Any] = {}
    for prefix, module in trained.items():
        for key, value in _jsonable(module.peft_config["default"].to_dict()).items():
            # peft records the folder the base model was loaded from: a worker's own path,
            # which would make the same job's file differ from node to node.
            if key != "base_model_name_or_path":
                adapter_metadata[f"{prefix}.{key}"] = value
    metadata = {
        "format": "pt",
        _ADAPTER_METADATA_KEY: json.dumps(adapter_metadata, indent=2, sort_keys=True),
    }
    return safetensors_bytes(lora_state_dict(family, trained), metadata)


def kohya_state_dict(family: Family, trained: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The LoRA in the family's kohya layout (what ComfyUI, A1111 and diffusers' kohya
    loaders read), with each layer's `.alpha` the adapter's lora_alpha."""
    alphas: dict[str, float] = {}
    for name, module in trained.items():
        config = module.peft_config["default"]
        if config.use_dora:
            # kohya's dora_scale layout differs from peft's magnitude vector; refused at submit.
            raise ValueError("the kohya format holds no DoRA adapters")
        alphas[name] = float(config.lora_alpha)
    return family.kohya_state_dict(_peft_states(trained), alphas)


def kohya_weights_bytes(family: Family, trained: Mapping[str, Any]) -> bytes:
    """The finished LoRA as `pytorch_lora_weights_kohya.safetensors` bytes."""
    return safetensors_bytes(kohya_state_dict(family, trained), {"format": "pt"})
