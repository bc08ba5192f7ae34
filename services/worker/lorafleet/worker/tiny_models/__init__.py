"""Randomly initialised stand-ins for the model families lorafleet trains, one module a family.

No weights can be downloaded where lorafleet is tested or demonstrated, so each module builds
a model with the *architecture* of its family (SDXL, FLUX.1, FLUX.2 [klein]) at a tiny size or
at the published full size, with tokenizers generated in-process, and saves it with the
family's diffusers pipeline `save_pretrained`: everything downstream loads it through the real
`from_pretrained` code paths. `lorafleet.worker.tiny_model.build_tiny_model` is the entry point.
"""
