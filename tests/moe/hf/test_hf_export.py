"""Hugging Face export (moe.hf.export.save_hf, the config.json writers) and loading's memory at pp=2 x ep=2.

One 4-rank gloo run (pp=2 x ep=2) serves every multi-rank check: each rank loads transformers-written checkpoints
of both architectures into its stages (counting what it reads), exports them with ``save_hf`` in small shards
(DualPipeV for Qwen3-MoE; DualPipe for DeepSeek-V3, whose stages sit twice, mirrored: every tensor is held by
two pipeline ranks and, dense ones, by both ep ranks, and must be written once), and loads a checkpoint that
``python -m moe.convert`` made from the Qwen3-MoE directory, with an optimizer, at this layout.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from moe.hf import HFConfigError, from_hf_config, load_hf_model, read_safetensors, to_hf_config
from moe.models.config import PRESETS
from moe.models.model import MoEModel, lm_loss
from tests.distributed import run_ranks
from tests.moe.hf import test_hf_deepseek_v3, test_hf_qwen3_moe

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ARCHITECTURES = {"qwen3_moe": test_hf_qwen3_moe._hf_model, "deepseek_v3": test_hf_deepseek_v3._hf_model}
SCHEDULES = {"qwen3_moe": "dualpipev", "deepseek_v3": "dualpipe", "big": "dualpipev"}
SHARD_BYTES = 200_000  # the tiny checkpoints are ~1 MB: several shards per rank


def _big_checkpoint(path: Path) -> None:
    """A Qwen3-MoE of 26 MB (fp32), almost all of it experts: 4 layers x 16 experts of 128 x 256."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
    )
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rank(rank: int, world: int, jobs: list[tuple[str, str, str | None, str]], converted: str) -> dict:
    """Per job: load ``src`` into this rank's stages at pp=2 x ep=2 (bytes read, peak-RSS growth), export it to
    ``dst``; for ``converted`` (our checkpoint of the first job's model): load it at this layout, with AdamW."""
    import moe.hf
    from moe.hf.export import save_hf
    from moe.parallel import ParallelConfig, build_stages, init_layout
    from moe.train.checkpoint import load_checkpoint
    from moe.train.grad_sync import make_optimizer

    read = [0]
    get = moe.hf._Files.__getitem__

    def counting(self, key: str) -> torch.Tensor:  # every tensor materialised from the files
        t = get(self, key)
        read[0] += t.nbytes
        return t

    moe.hf._Files.__getitem__ = counting
    out: dict = {}
    for name, src, dst, schedule in jobs:
        cfg = moe.hf.read_hf_config(src)
        layout = init_layout(ParallelConfig(pp=2, ep=2, schedule=schedule))
        stages = build_stages(cfg, layout)
        read[0], before = 0, _maxrss_bytes()
        moe.hf.load_hf_weights(stages, src)
        out[name] = {"read": read[0], "rss": _maxrss_bytes() - before}
        if dst is not None:
            save_hf(stages, dst, cfg, max_shard_bytes=SHARD_BYTES)
        if name == jobs[0][0]:
            other = build_stages(cfg, layout, seed=7)
            optimizer = make_optimizer(other, layout, "adamw")
            load_checkpoint(converted, other, optimizer)
            pairs = [(a.state_dict(), b.state_dict()) for a, b in zip(stages, other)]
            out["converted_equal"] = all(torch.equal(a[k], b[k]) for a, b in pairs for k in a)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    from moe.convert import main as convert

    tmp = tmp_path_factory.mktemp("export")
    for name, build in ARCHITECTURES.items():
        build().save_pretrained(tmp / "src" / name)
    _big_checkpoint(tmp / "src" / "big")
    convert([str(tmp / "src" / "qwen3_moe"), str(tmp / "converted")])
    jobs = [
        (name, str(tmp / "src" / name), None if name == "big" else str(tmp / "out" / name), SCHEDULES[name])
        for name in (*ARCHITECTURES, "big")
    ]
    return tmp, run_ranks(_rank, 4, args=(jobs, str(tmp / "converted" / "step_00000000")), timeout=180)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_an_export_is_what_save_pretrained_writes_and_transformers_computes_our_loss(run, arch: str) -> None:
    tmp, _ = run
    src, out = tmp / "src" / arch, tmp / "out" / arch
    # the names transformers' save_pretrained wrote, exactly (from_pretrained would also take fused experts),
    # each tensor the one loaded: written once although DualPipe and ep hold most of them twice or more
    want, got = read_safetensors(src), read_safetensors(out)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_hf_model(out).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf.eval()(ids, labels=ids).loss.item()
        mine = lm_loss(ours(ids)[:, :-1], ids[:, 1:]).item()
    assert mine == pytest.approx(theirs, rel=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_shards_are_numbered_across_ranks_with_a_valid_index(run, arch: str) -> None:
    from safetensors import safe_open

    out = run[0] / "out" / arch
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 4 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = set(f.keys())
            total += sum(f.get_tensor(k).nbytes for k in keys)
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
        assert (out / name).stat().st_size <= SHARD_BYTES + 64 * 1024  # tensors plus the safetensors header
    assert index["metadata"]["total_size"] == total
    assert not list(out.parent.glob(".*partial"))


def test_each_rank_reads_its_share_of_the_checkpoint(run) -> None:
    """Loading at pp=2 x ep=2 (DualPipeV: pipeline rank 0 holds layers 0 and 3, rank 1 layers 1 and 2; each ep
    rank 8 of the 16 experts): each rank materialises from the files only the tensors of its own layers and,
    of their experts, its own, about a quarter of the 26 MB checkpoint (every byte counted as the loader gets
    it from safetensors). Its peak RSS grows by what it reads and the temporaries of one layer's experts
    (its stages are allocated before): far below the checkpoint, which a rank reading the whole model (or
    even all experts of its layers) exceeds."""
    tmp, results = run
    total = sum(t.nbytes for t in read_safetensors(tmp / "src" / "big").values())
    assert total > 25e6
    for rank, r in enumerate(results):
        big = r["big"]
        assert 0.2 * total < big["read"] < 0.3 * total, (rank, big, total)
        assert big["rss"] < 0.5 * total, (rank, big, total)


def test_a_converted_checkpoint_loads_at_another_layout_with_an_optimizer(run) -> None:
    assert all(r["converted_equal"] for r in run[1])


def test_config_json_round_trips_for_every_preset_of_the_published_architectures(tmp_path: Path) -> None:
    families = {"gqa-qk-norm": "qwen3_moe", "mla": "deepseek_v3"}
    for name, cfg in PRESETS.items():
        if cfg.attention not in families or name == "deepseek-v2-lite":
            continue
        raw = to_hf_config(cfg)
        assert raw["model_type"] == families[cfg.attention]
        assert from_hf_config(raw) == cfg, name
        (tmp_path / "config.json").write_text(json.dumps(raw))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)  # and transformers reads it the same
        assert loaded.model_type == raw["model_type"] and from_hf_config(loaded.to_dict()) == cfg, name
    for name, field in [("v3", "attention"), ("tiny", "attention"), ("deepseek-v2-lite", "router_scoring")]:
        with pytest.raises(HFConfigError, match=rf"MoEConfig\.{field} = ") as err:
            to_hf_config(PRESETS[name])
        assert "\n" not in str(err.value)
    with pytest.raises(HFConfigError, match=r"qwen3_moe cannot express MoEConfig\.num_shared_experts = 1"):
        to_hf_config(PRESETS["qwen3-moe-tiny"].replace(num_shared_experts=1))


def test_config_json_sets_what_changed_in_the_source_s_spelling(tmp_path: Path) -> None:
    test_hf_qwen3_moe._hf_model().config.save_pretrained(tmp_path / "qwen")  # transformers 5.x's spelling
    raw = json.loads((tmp_path / "qwen" / "config.json").read_text()) | {"dtype": "float32"}  # as a model writes
    cfg = from_hf_config(raw).replace(num_experts=16, rope_theta=5e5, vocab_size=256)
    out = to_hf_config(cfg, dtype="bfloat16", source=raw)
    assert (out["num_local_experts"], out["rope_parameters"]["rope_theta"], out["vocab_size"]) == (16, 5e5, 256)
    assert out["dtype"] == "bfloat16" and not {"num_experts", "rope_theta", "torch_dtype"} & set(out)
    changed = {"num_local_experts", "rope_parameters", "vocab_size", "dtype"}
    assert set(out) == set(raw) and all(out[k] == raw[k] for k in set(raw) - changed)
    assert from_hf_config(out) == cfg
    # DeepSeek-V3 published as FP8 with an MTP module the tensors lack: the weights are written dequantized, and
    # num_nextn_predict_layers stays as transformers writes it (our reader drops it again: no such tensors)
    test_hf_deepseek_v3._hf_model().config.save_pretrained(tmp_path / "v3")
    raw = json.loads((tmp_path / "v3" / "config.json").read_text()) | {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}
    }
    cfg = from_hf_config(raw).replace(mtp_layers=0)
    out = to_hf_config(cfg, source=raw)
    assert out == {k: v for k, v in raw.items() if k != "quantization_config"}
    # a change the source's spelling cannot carry is one line naming the field; another architecture's source
    # is ignored
    with pytest.raises(HFConfigError, match=r"cannot write .*rope_scaling into the source") as err:
        to_hf_config(cfg.replace(rope_factor=8.0), source=raw)
    assert "\n" not in str(err.value)
    assert to_hf_config(cfg) == to_hf_config(cfg, source=json.loads((tmp_path / "qwen" / "config.json").read_text()))


def test_an_mtp_model_exports_its_layer_as_published(tmp_path: Path) -> None:
    from moe.hf.export import save_hf
    from moe.models.config import preset

    cfg = preset("deepseek-v3-tiny")
    assert cfg.mtp_layers == 1
    model = MoEModel(cfg, seed=3)
    save_hf([model], tmp_path / "out", cfg)  # one process, no process group
    names = set(read_safetensors(tmp_path / "out"))
    layer = f"model.layers.{cfg.num_layers}"
    assert {f"{layer}.eh_proj.weight", f"{layer}.embed_tokens.weight", f"{layer}.shared_head.head.weight"} <= names
    back = load_hf_model(tmp_path / "out")
    assert back.cfg == cfg
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_a_failed_export_leaves_nothing_and_a_used_target_is_refused(tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    from moe.hf.export import HFExportError, save_hf
    from moe.models.config import preset

    cfg = preset("qwen3-moe-tiny")
    model = MoEModel(cfg)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    with pytest.raises(HFExportError, match=r"used exists and is not an empty directory"):
        save_hf([model], used, cfg)
    assert sorted(p.name for p in used.iterdir()) == ["keep.txt"]
    calls = []
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):  # the second shard fails
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(HFExportError, match=r"rank 0: OSError: \[Errno 28\] No space left on device"):
        save_hf([model], tmp_path / "new", cfg, max_shard_bytes=50_000)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["used"]
