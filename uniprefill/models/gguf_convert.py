"""Turn a GGUF checkpoint into a plain Hugging Face folder once, then load that folder.

Why a conversion: transformers reads a GGUF through its quantizer machinery. Depending on the
version and architecture it either keeps the weights packed (matmuls then run dequantizing
kernels, so a benchmark would time those kernels instead of the model) or dequantizes them at
load time, which takes most of a minute per load. Either way the model carries an
`hf_quantizer` and a `quantization_config`, which `save_pretrained` refuses and which our
graph rewrites should never see. So each GGUF is loaded once with `dequantize=True`, checked
to hold only plain float `nn.Linear`/`nn.Embedding` weights, stripped of its quantizer, and
saved as safetensors with its tokenizer. Later loads are a plain `from_pretrained(folder)`.

A folder counts as converted only once `MARKER_FILE` is in it: the conversion writes into a
temporary sibling folder and renames it into place as its last step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from uniprefill import env

__all__ = [
    "MARKER_FILE",
    "TransformersTooOldError",
    "convert_gguf_to_hf",
    "is_converted",
    "load_hf_folder",
    "require_transformers",
]

MARKER_FILE = "uniprefill_source.json"


class TransformersTooOldError(RuntimeError):
    """The installed transformers cannot do what was asked (names the version it needs)."""


def require_transformers(minimum: str, why: str) -> None:
    """Raise `TransformersTooOldError` unless `transformers >= minimum` is installed."""
    import transformers
    from packaging.version import Version

    have = Version(transformers.__version__)
    if have < Version(minimum):
        raise TransformersTooOldError(
            f"transformers>={minimum} is needed to {why}; found {transformers.__version__} "
            f"(at {Path(transformers.__file__).parent}). Install it with "
            f"`pip install 'transformers>={minimum}'`, or put a newer copy first on PYTHONPATH."
        )


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion."""
    return (Path(folder) / MARKER_FILE).is_file()


def _check_plain(model: torch.nn.Module) -> None:
    """Raise if any GGUF-specific module or non-float weight survived the load."""
    for name, module in model.named_modules():
        if "gguf" in type(module).__module__.lower() or "gguf" in type(module).__name__.lower():
            raise RuntimeError(f"module {name!r} is still a GGUF module ({type(module).__name__})")
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point:
            raise RuntimeError(f"parameter {name!r} is still packed ({param.dtype})")


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    source: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Dequantize `gguf_path` into a plain HF folder `out_dir` (weights in `dtype`).

    `source` is recorded in `MARKER_FILE` beside the transformers version and dtype. An
    existing finished conversion is kept unless `overwrite`. Returns `out_dir`.
    """
    env.force_hub_offline()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(out_dir) and not overwrite:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    load_kw = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **load_kw)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        dtype=torch.float32,  # dequantize in full precision; cast once below
        quantization_config=GgufConfig(dequantize=True),
        **load_kw,
    )
    _check_plain(model)
    # The weights are plain now; what is left of the quantizer only blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(dtype)
    model.config.dtype = dtype

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {
            "source": source or {"gguf": gguf_path.name},
            "converted_with_transformers": transformers.__version__,
            "dtype": str(dtype).removeprefix("torch."),
        }
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary folder
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def load_hf_folder(folder: Path, dtype: torch.dtype, device: str | torch.device):
    """`(model, tokenizer)` from a converted folder: SDPA attention, eval mode, on `device`."""
    env.force_hub_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return model, tokenizer
