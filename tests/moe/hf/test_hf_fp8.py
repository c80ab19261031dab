"""DeepSeek-V3's block-scaled FP8 weights dequantized on load (moe.hf.fp8): a tiny DeepSeek-V3 written by
transformers, its projection matrices quantized by our own code in 16 x 24 blocks (config.json's
``weight_block_size``; most blocks at the edges partial), loads to exactly the dequantized reference and to
the unquantized model within FP8's error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from moe.hf import (
    HFCheckpointError,
    HFConfigError,
    from_hf_config,
    load_hf_model,
    read_safetensors,
    to_hub,
    to_ours,
)
from moe.hf.fp8 import FP8_MAX, dequantize_blockwise, quantize_blockwise
from moe.hf.keys import checkpoint_shapes
from moe.models.model import lm_loss
from tests.moe.hf import test_hf_deepseek_v3

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

BLOCK = (16, 24)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def _quantized(name: str) -> bool:
    """As published: every projection matrix of the layers is FP8; embedding, head, norms, router stay."""
    return re.fullmatch(r"model\.layers\..*_proj(_with_mqa)?\.weight", name) is not None


def test_blockwise_round_trip_with_partial_blocks() -> None:
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(0))
    w[16:32, 24:48] = 0  # an all-zero block stays zero
    q, scale = quantize_blockwise(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 3)  # ceil(50/16) x ceil(70/24)
    got = dequantize_blockwise(q, scale, BLOCK)
    for i in range(4):  # the definition, block by block (the last row and column of blocks partial)
        for j in range(3):
            rows, cols = slice(16 * i, 16 * i + 16), slice(24 * j, 24 * j + 24)
            assert torch.equal(got[rows, cols], q[rows, cols].float() * scale[i, j])
            amax = w[rows, cols].abs().max()
            assert torch.allclose(scale[i, j], amax / FP8_MAX) or amax == 0
            # e4m3 keeps 3 mantissa bits: at most half a step (16 at the top, 448) of the scaled value
            assert (got[rows, cols] - w[rows, cols]).abs().max() <= 16 * scale[i, j] * (1 + 1e-6)
    assert got[16:32, 24:48].abs().max() == 0
    with pytest.raises(HFCheckpointError, match=r"^x_scale_inv: shape \(4, 2\) for x of shape \(50, 70\)"):
        dequantize_blockwise(q, scale[:, :2], BLOCK, name="x")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the transformers-written checkpoint, its copy with FP8 projections)."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("fp8")
    test_hf_deepseek_v3._hf_model().save_pretrained(tmp / "bf")
    tensors = {}
    for name, t in read_safetensors(tmp / "bf").items():
        if _quantized(name):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_blockwise(t, BLOCK)
        else:
            tensors[name] = t
    (tmp / "fp8").mkdir()
    save_file(tensors, str(tmp / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "bf" / "config.json").read_text())
    (tmp / "fp8" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    return tmp / "bf", tmp / "fp8"


def _reference(path: Path) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors dequantized by the definition, scales dropped."""
    files = read_safetensors(path)
    out = {}
    for name, t in files.items():
        if name.endswith("_scale_inv"):
            continue
        out[name] = dequantize_blockwise(t, files[f"{name}_scale_inv"], BLOCK) if _quantized(name) else t
    return out


def test_fp8_weights_load_dequantized_and_close_to_the_unquantized_model(fp8_checkpoint) -> None:
    bf, fp8 = fp8_checkpoint
    ours = load_hf_model(fp8).eval()
    state = ours.state_dict()
    want = to_ours(_reference(fp8), checkpoint_shapes(ours))
    assert all(torch.equal(state[k], v) for k, v in want.items())
    plain = load_hf_model(bf).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss_fp8 = lm_loss(ours(ids)[:, :-1], ids[:, 1:]).item()
        loss = lm_loss(plain(ids)[:, :-1], ids[:, 1:]).item()
    # in the hub layout: each FP8 matrix within half an e4m3 step (16 x its block's scale) of the original,
    # every other tensor untouched
    original, files = read_safetensors(bf), read_safetensors(fp8)
    exported = to_hub({k: state[k] for k in checkpoint_shapes(ours)})
    for name, t in original.items():
        if _quantized(name):
            bound = 16 * dequantize_blockwise(torch.ones_like(t), files[f"{name}_scale_inv"], BLOCK)
            assert (exported[name] - t).abs().max() > 0 and ((exported[name] - t).abs() <= bound * 1.0001).all()
        else:
            assert torch.equal(exported[name], t), name
    assert loss_fp8 != loss and loss_fp8 == pytest.approx(loss, rel=0.05)


def test_fp8_conversion_to_our_checkpoint_and_back_gives_the_dequantized_weights(fp8_checkpoint, tmp_path) -> None:
    from moe.convert import main as convert

    _, fp8 = fp8_checkpoint
    convert([str(fp8), str(tmp_path / "ours")])
    convert([str(tmp_path / "ours"), str(tmp_path / "hf")])
    got, want = read_safetensors(tmp_path / "hf"), _reference(fp8)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_a_missing_scale_or_another_quantization_is_one_line(fp8_checkpoint, tmp_path) -> None:
    from safetensors.torch import save_file

    _, fp8 = fp8_checkpoint
    tensors = read_safetensors(fp8)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    del tensors[f"{gone}_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((fp8 / "config.json").read_text())
    message = f"{gone} is torch.float8_e4m3fn but the checkpoint lacks its scales {gone}_scale_inv"
    with pytest.raises(HFCheckpointError, match=f"^{re.escape(message)}$"):
        load_hf_model(tmp_path)
    config = json.loads((fp8 / "config.json").read_text())
    with pytest.raises(HFConfigError, match=r"^quantization_config: quant_method 'bitsandbytes'"):
        from_hf_config({**config, "quantization_config": {"quant_method": "bitsandbytes"}})
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"is torch.float8_e4m3fn but config.json has no quantization_config"):
        load_hf_model(tmp_path)
