"""The trainer benchmark's families (issue 33): each diffusers script is asked to train as
lorafleet does (klein with its pipeline's Qwen3 layers, not the script's FLUX.2 [dev] default;
cached latents; alpha = rank), and lorafleet's side trains each tiny model and writes its
figures."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.bench_trainer import (
    _HARNESS,
    KLEIN_TEXT_ENCODER_LAYERS,
    _shim_dir,
    main,
    reference_args,
)


def args_for(family: str, tmp_path: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = {
        "model_dir": tmp_path / "model",
        "image_dir": tmp_path / "images",
        "out": tmp_path / "out",
        "work": tmp_path,
        "steps": 4,
        "checkpoint_every": 2,
        "resolution": 64,
        "text_encoder": False,
        "gpu": False,
    }
    return reference_args(family, **(settings | overrides))  # type: ignore[arg-type]


def test_klein_script_reads_the_pipelines_layers_and_caches_latents(tmp_path: Path) -> None:
    args = args_for("flux2", tmp_path, rank=16)
    at = args.index("--text_encoder_out_layers")
    assert args[at + 1 : at + 4] == ["9", "18", "27"]
    assert KLEIN_TEXT_ENCODER_LAYERS == (9, 18, 27)
    assert {"--cache_latents", "--rank=16", "--lora_alpha=16"} <= set(args)
    assert not any(a.startswith("--text_encoder_lr") for a in args)


def test_flux_script_gets_cached_latents_and_sdxl_keeps_its_arguments(tmp_path: Path) -> None:
    flux = args_for("flux", tmp_path, text_encoder=True)
    assert {"--cache_latents", "--lora_alpha=4", "--train_text_encoder"} <= set(flux)
    assert "--text_encoder_out_layers" not in flux
    sdxl = args_for("sdxl", tmp_path)
    # The SDXL script has neither option: its alpha is its rank and it encodes every step.
    assert not {a for a in sdxl if a.startswith(("--lora_alpha", "--cache_latents"))}


def test_nf4_only_where_the_script_can_quantize(tmp_path: Path) -> None:
    args = args_for("flux2", tmp_path, gpu=True, base_quantization="nf4")
    (config,) = [a.split("=", 1)[1] for a in args if a.startswith("--bnb_quantization_config")]
    assert json.loads(Path(config).read_text()) == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
    }
    with pytest.raises(SystemExit, match="no quantized base"):
        args_for("flux", tmp_path, gpu=True, base_quantization="nf4")
    with pytest.raises(SystemExit, match="never trained"):
        args_for("flux2", tmp_path, text_encoder=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_lorafleet_trains_each_tiny_model_and_writes_its_figures(
    family: str, tmp_path: Path, tiny_flux_dir: Path, tiny_flux2_dir: Path
) -> None:
    model = {"flux": tiny_flux_dir, "flux2": tiny_flux2_dir}[family]
    out = tmp_path / "figures.json"
    main(
        [
            f"--family={family}",
            f"--model-dir={model}",
            "--text-encoder=frozen",
            "--steps=3",
            "--checkpoint-every=2",
            "--repeats=1",
            "--images=1",
            f"--json-file={out}",
        ]
    )
    (result,) = json.loads(out.read_text())
    assert result["family"] == family and result["trainer"] == "lorafleet"
    assert result["checkpoints"] == 1 and result["lora_bytes"] > 0
    assert result["peak_rss_bytes"] is None or result["peak_rss_bytes"] > 0


def test_the_scripts_peak_memory_is_its_own_not_the_benchmarks(tmp_path: Path) -> None:
    """getrusage's ru_maxrss carries the forking process's peak across the exec: the harness
    reported the benchmark's own (larger) peak as the script's. It reads the script's VmHWM."""
    ballast = np.ones(768 * 2**20 // 8)  # 768 MiB resident in this process, then freed
    ballast.fill(2.0)
    del ballast
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    out = tmp_path / "times.json"
    harness = _HARNESS.format(shim=_shim_dir(sys.executable, tmp_path), threads=1)
    # A bound: the script imports torch, diffusers and peft, over 120 s beside another suite.
    subprocess.run([sys.executable, "-c", harness, str(script), str(out)], check=True, timeout=240)
    peak = json.loads(out.read_text())["peak_rss_bytes"]
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert own > 768 * 2**20
    # The script's process imports torch, diffusers, transformers and peft: well under that.
    assert 0 < peak < own - 256 * 2**20
