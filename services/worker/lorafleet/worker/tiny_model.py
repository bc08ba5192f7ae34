"""Randomly initialised SDXL, FLUX.1 or FLUX.2 [klein] models, saved in the diffusers layout.

No weights can be downloaded where lorafleet is tested or demonstrated, so this builds a
stand-in with the *architecture* of a family (the modules of `lorafleet.worker.tiny_models`,
one a family, say where every dimension comes from) and saves it with the family's pipeline
`save_pretrained` (`StableDiffusionXLPipeline`, `FluxPipeline`, `Flux2KleinPipeline`), so that
everything downstream loads it through the real `from_pretrained` code paths.

Each family has a `"tiny"` preset (trains at 32 or 64 px on one CPU thread in well under a
second per step; used by the tests, `lorafleet demo` and the CPU benchmark) and its full-size
presets with random weights (`"sdxl"`, `"flux-dev"`, `"klein-4b"`, `"klein-9b"`) for measuring
step time and memory on an accelerator at 1024 px.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from lorafleet.worker.tiny_models import flux, flux2, sdxl
from lorafleet.worker.tiny_models.common import WeightsDtype
from lorafleet.worker.tiny_models.sdxl import PRESETS, ModelShape, SdxlPreset
from lorafleet.worker.tiny_models.tokenizers import bpe_vocab_and_merges

Family = Literal["sdxl", "flux", "flux2"]

# The presets of each family, first the tiny one.
FAMILY_PRESETS: dict[Family, tuple[str, ...]] = {
    "sdxl": tuple(sdxl.PRESETS),
    "flux": tuple(flux.PRESETS),
    "flux2": tuple(flux2.PRESETS),
}

__all__ = [
    "FAMILY_PRESETS",
    "PRESETS",
    "Family",
    "ModelShape",
    "SdxlPreset",
    "WeightsDtype",
    "bpe_vocab_and_merges",
    "build_tiny_model",
]


def build_tiny_model(
    directory: str | Path,
    *,
    family: Family = "sdxl",
    preset: str = "tiny",
    seed: int = 0,
    weights_dtype: WeightsDtype = "fp32",
) -> Path:
    """Builds a random model of `family` at `preset`'s size and saves it as the family's
    diffusers pipeline at `directory`. Returns the path.

    The same arguments write the same files. `weights_dtype` "bf16" halves the files of the
    full-size presets (the VAEs stay fp32, as the families publish them).
    """
    presets = FAMILY_PRESETS.get(family)
    if presets is None:
        raise ValueError(f"family must be one of {sorted(FAMILY_PRESETS)}, not {family!r}")
    if preset not in presets:
        raise ValueError(f"preset of family {family!r} must be one of {presets}, not {preset!r}")
    if family == "flux":
        return flux.build_flux(
            directory, preset=flux.PRESETS_BY_NAME[preset], seed=seed, weights_dtype=weights_dtype
        )
    if family == "flux2":
        return flux2.build_flux2(
            directory, preset=flux2.PRESETS_BY_NAME[preset], seed=seed, weights_dtype=weights_dtype
        )
    return sdxl.build_sdxl(
        directory, preset=sdxl.PRESETS_BY_NAME[preset], seed=seed, weights_dtype=weights_dtype
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m lorafleet.worker.tiny_model DIR [--family flux] [--preset flux-dev]`."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--family", choices=sorted(FAMILY_PRESETS), default="sdxl")
    parser.add_argument(
        "--preset",
        default="tiny",
        help="; ".join(f"{f}: {', '.join(p)}" for f, p in FAMILY_PRESETS.items()),
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args(argv)
    if args.preset not in FAMILY_PRESETS[args.family]:
        parser.error(
            f"--preset of --family {args.family} must be one of "
            f"{', '.join(FAMILY_PRESETS[args.family])}, not {args.preset!r}"
        )
    path = build_tiny_model(
        args.directory,
        family=args.family,
        preset=args.preset,
        seed=args.seed,
        weights_dtype=args.weights_dtype,
    )
    print(path)


if __name__ == "__main__":
    main()
