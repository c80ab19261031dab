"""Hugging Face interop: ``config.json`` to our config and back (:mod:`.config`), checkpoint names both ways
(:mod:`.keys`), loading a checkpoint directory into a model (:func:`load_hf_model`; FP8 weights dequantized,
:mod:`.fp8`) and writing one from a model's stages (:func:`moe.hf.export.save_hf`).

``safetensors`` is imported lazily (the ``hf`` extra): ``pip install 'dualpipe-moe[hf]'``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from moe.hf.config import (
    HF_CONFIGS,
    HFConfigError,
    from_hf_config,
    quantization_block,
    read_hf_config,
    to_hf_config,
    weight_map,
)
from moe.hf.fp8 import Dequantized
from moe.hf.keys import RULES, HFCheckpointError, checkpoint_shapes, to_hub, to_ours
from moe.models.model import MoEModel
from moe.models.stage import MoEStage

__all__ = [
    "HF_CONFIGS",
    "RULES",
    "HFCheckpointError",
    "HFConfigError",
    "from_hf_config",
    "hf_tensors",
    "load_hf_model",
    "load_hf_weights",
    "read_hf_config",
    "read_safetensors",
    "to_hf_config",
    "to_hub",
    "to_ours",
]


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists."""
    return dict(_Files(Path(path)))


def hf_tensors(path: str | Path) -> Mapping[str, torch.Tensor]:
    """A checkpoint directory's tensors by name, each read from its file only when asked for; FP8 block-quantized
    weights come dequantized to float32 (config.json's ``quantization_config``; an FP8 tensor without its scales
    is an :class:`HFCheckpointError` naming it)."""
    path = Path(path)
    files = _Files(path)
    config = path / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    try:
        return Dequantized(files, quantization_block(raw))
    except HFConfigError as exc:
        raise HFCheckpointError(str(exc)) from None


def load_hf_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> MoEModel:
    """The whole model of a Hugging Face checkpoint directory in one process (config.json + safetensors); every
    tensor of the files must find its place."""
    model = MoEModel(read_hf_config(path))
    load_hf_weights([model], path, whole=True)
    return model.to(dtype)


def _bin_hint(path: Path) -> str:
    """For a directory of PyTorch pickles (``pytorch_model.bin`` or its shards), how to make them safetensors:
    we read no pickles (loading one can run code)."""
    if not any(path.glob("*.bin")):
        return ""
    return (
        "; it holds PyTorch .bin weights, which are not read here: save them as safetensors, e.g. in transformers "
        "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True)"
    )


class _Files(Mapping[str, torch.Tensor]):
    """A checkpoint directory's tensors by name, each read from its file only when asked for (safetensors maps
    the file; a rank touches only the tensors of its stages and experts)."""

    def __init__(self, path: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise HFCheckpointError(
                "reading safetensors needs the safetensors package: pip install 'dualpipe-moe[hf]'"
            ) from None
        where = weight_map(path)
        if where is None:
            raise HFCheckpointError(
                f"{path}: neither model.safetensors nor model.safetensors.index.json{_bin_hint(path)}"
            )
        self._where = where
        self._files = {name: safe_open(str(path / name), framework="pt") for name in set(self._where.values())}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._files[self._where[key]].get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_weights(stages: Sequence[MoEStage], path: str | Path, *, whole: bool = False) -> None:
    """Set this rank's stages from a Hugging Face checkpoint directory: each reads only its own layers' tensors
    and, of each expert tensor, its local experts (``dispatcher.local_experts``). Collective-free. ``whole``:
    one stage that is the whole model, so a tensor of the files with no place in it is an error."""
    if whole and len(stages) != 1:
        raise ValueError("whole=True takes one stage holding the whole model")
    files = hf_tensors(path)
    for stage in stages:
        first = stage.dispatcher.local_experts.start
        ours = to_ours(files, checkpoint_shapes(stage), first_expert=first, whole=whole)
        state = stage.state_dict()  # parameters and buffers, sharing their storage
        with torch.no_grad():
            for key, value in ours.items():
                state[key].copy_(value)
