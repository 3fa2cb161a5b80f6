"""Models uniprefill is developed and benchmarked on. Import the submodule you need:

- `gemma`: Gemma-3-270M base, the embedded default real model (`load_gemma3_270m`), from a
  PyPI weight package, converted once from GGUF into a plain HF folder.
- `smollm2`: SmolLM2-135M-Instruct, a full-attention Llama (`load_smollm2_135m`), likewise.
- `presets`: random-weight configs by name, tiny CPU-test hybrids and benchmark shapes
  (`preset_config`, `build_random_model`).
- `layer_kinds`: the `LayerKind` vocabulary (full, sliding, linear, other) and its derivation
  per decoder layer of a config.
- `gguf_convert`: the shared GGUF -> plain HF folder conversion; `sanity`: smoke checks.

Nothing is imported here, so `import uniprefill.models` stays free of transformers.
"""
