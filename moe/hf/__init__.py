"""Hugging Face interop: ``config.json`` to our config (:mod:`.config`), checkpoint names both ways
(:mod:`.keys`), and loading a checkpoint directory into a model (:func:`load_hf_model`).

``safetensors`` is imported lazily (the ``hf`` extra): ``pip install 'dualpipe-moe[hf]'``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe.hf.config import HF_CONFIGS, HFConfigError, from_hf_config, read_hf_config
from moe.hf.keys import RULES, HFCheckpointError, to_hub, to_ours
from moe.model import MoEModel

__all__ = [
    "HF_CONFIGS",
    "RULES",
    "HFCheckpointError",
    "HFConfigError",
    "from_hf_config",
    "load_hf_model",
    "read_hf_config",
    "read_safetensors",
    "to_hub",
    "to_ours",
]


def _safetensors():
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise HFCheckpointError(
            "reading safetensors needs the safetensors package: pip install 'dualpipe-moe[hf]'"
        ) from None
    return load_file


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists."""
    path = Path(path)
    load_file = _safetensors()
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise HFCheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return tensors


def load_hf_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> MoEModel:
    """The whole model of a Hugging Face checkpoint directory in one process (config.json + safetensors)."""
    cfg = read_hf_config(path)
    model = MoEModel(cfg)
    shapes = {k: p.shape for k, p in model.named_parameters()}
    ours = to_ours(read_safetensors(path), shapes)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(ours[key])
    return model.to(dtype)
