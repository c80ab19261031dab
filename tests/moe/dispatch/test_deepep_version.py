"""The lazy import of DeepEP says which API it found: V1, V2 through its legacy Buffer, or one too old."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe.dispatch.deepep import DEEPEP_INSTALL_HINT, DEEPEP_V1_COMMIT, deep_ep_api, import_deep_ep
from tests.moe.dispatch import fake_deep_ep


class _V1Buffer:
    """The entry points of V1's Buffer at the targeted commit (deep_ep/buffer.py), bodies irrelevant here."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, explicitly_destroy=False, comm=None): ...

    set_num_sms = capture = get_dispatch_config = get_combine_config = staticmethod(lambda *a: None)
    get_dispatch_layout = dispatch = combine = destroy = lambda self, *a, **k: None


class _OldV1Buffer(_V1Buffer):
    # Before commit 0c984e2 (2025-07-11): no explicitly_destroy, no destroy().
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, comm=None): ...

    destroy = None


def _module(name="deep_ep", **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"/site-packages/{name}/__init__.py"
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_v1_is_reported_with_the_target_commit():
    api = deep_ep_api(_module(Buffer=_V1Buffer, topk_idx_t=torch.int64))
    assert api.generation == 1 and api.buffer_cls is _V1Buffer
    assert "V1 Buffer API" in api.describe() and DEEPEP_V1_COMMIT[:7] in api.describe()


def test_v2_is_reached_through_its_legacy_buffer():
    # V2's deep_ep/__init__.py: Buffer from buffers.legacy, ElasticBuffer beside it, __version__ '2.1.0'.
    module = _module(Buffer=_V1Buffer, ElasticBuffer=object, __version__="2.1.0", topk_idx_t=torch.int64)
    api = deep_ep_api(module)
    assert (api.generation, api.version, api.buffer_cls) == (2, "2.1.0", _V1Buffer)
    assert "legacy V1 Buffer" in api.describe() and "deepep-v2" in api.describe()


def test_too_old_v1_names_what_is_missing():
    with pytest.raises(ImportError, match=r"older than the V1 API.*destroy.*explicitly_destroy.*0c984e2"):
        deep_ep_api(_module(Buffer=_OldV1Buffer))


def test_32_bit_expert_ids_are_refused():
    with pytest.raises(ImportError, match=r"topk_idx_t=torch.int32.*int64"):
        deep_ep_api(_module(Buffer=_V1Buffer, topk_idx_t=torch.int32))


def test_no_buffer_at_all():
    with pytest.raises(ImportError, match="has no Buffer class"):
        deep_ep_api(_module())


def test_the_emulation_passes_as_v1():
    # The in-test emulation is what every deepep test runs on: it must present the full V1 API.
    api = deep_ep_api(fake_deep_ep)
    assert api.generation == 1 and api.buffer_cls is fake_deep_ep.Buffer


def test_v2_nccl_assert_becomes_an_import_error(monkeypatch):
    # DeepEP 2.x asserts at import that torch's libnccl is the one it linked (check_nccl_so).
    class _Finder:
        def find_spec(self, name, path=None, target=None):
            if name != "deep_ep":
                return None
            loader = types.SimpleNamespace(
                create_module=lambda spec: None,
                exec_module=lambda module: (_ for _ in ()).throw(
                    AssertionError("Invalid NCCL versions: /torch/libnccl.so.2 (loaded) v.s. /nccl/libnccl.so.2")
                ),
            )
            import importlib.util

            return importlib.util.spec_from_loader(name, loader)

    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Finder(), *sys.meta_path])
    with pytest.raises(ImportError, match=r"Invalid NCCL versions.*2\.30\.4"):
        import_deep_ep()


def test_install_hint_pins_the_commit():
    assert f"git checkout {DEEPEP_V1_COMMIT[:7]}" in DEEPEP_INSTALL_HINT and "docs/gpu.md" in DEEPEP_INSTALL_HINT
