"""The transformers-facing layer (rollout/model/compat.py, rollout/cache/static.py) and the package-name guard.

`make test` runs this file on both ends of the tested transformers range.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers.cache_utils import Cache

from rollout.cache.pool import CachePool
from rollout.cache.static import CacheShape, StaticKVCache
from rollout.model import compat
from rollout.ops import masks
from rollout.testing import random_prompts, tiny_model


def test_cache_keyword_matches_the_installed_transformers(qwen):
    kwarg = compat._cache_kwarg(type(qwen))
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert kwarg == ("cache" if (major, minor) >= (5, 24) else "past_key_values")


def _shape(batch=2, capacity=10):
    return CacheShape(batch, capacity, 2, 2, 16, torch.float32, torch.device("cpu"))


def test_static_cache_subclasses_the_library_base_and_keeps_addresses():
    cache = StaticKVCache(_shape())
    assert isinstance(cache, Cache)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    cache.set_window(torch.tensor([3, 4]), 5)
    k = torch.randn(2, 2, 2, 16)
    keys, values = cache.update(k, k * 2, 1)
    assert keys.shape == (2, 2, 5, 16)
    assert torch.equal(keys[:, :, 3:5], k) and torch.equal(values[:, :, 3:5], 2 * k)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == ptrs
    assert cache.get_seq_length() == 5


def test_cache_view_shares_storage_and_pool_reuses_it():
    pool = CachePool(keep=True)
    big = pool.acquire(_shape(4, 20))
    small = pool.acquire(_shape(2, 12))
    assert pool.num_allocations == 1
    assert small.layers[0].keys.data_ptr() == big.layers[0].keys.data_ptr()
    pool.acquire(_shape(8, 12))
    assert pool.num_allocations == 2
    with pytest.raises(ValueError, match="does not fit"):
        StaticKVCache(_shape(2, 5)).view(_shape(3, 5))


def test_eager_mask_is_additive_and_sdpa_mask_is_boolean():
    keep = torch.tensor([[[[True, False]]]])
    sdpa, eager = tiny_model(seed=0), tiny_model(seed=0, attn_implementation="eager")
    assert compat.to_model_mask(keep, sdpa, torch.float32).dtype == torch.bool
    additive = compat.to_model_mask(keep, eager, torch.float32)
    assert additive[0, 0, 0, 0] == 0 and additive[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_prefill_mask_lets_padding_queries_see_themselves_only():
    _, mask = random_prompts(2, 4, min_len=2, seed=1)
    mask[1] = torch.tensor([0, 0, 1, 1])
    keep = masks.prefill_mask(mask)[:, 0]
    assert keep[1, 0].tolist() == [True, False, False, False]  # padding: itself only (no NaN row)
    assert keep[1, 3].tolist() == [False, False, True, True]  # real token: real keys, causally
    assert masks.prompt_positions(mask)[1].tolist() == [1, 1, 0, 1]


def test_unwrap_and_geometry(qwen):
    class FakeEngine:
        module = qwen

        def zero_optimization_stage(self):
            return 0
    assert compat.unwrap_model(FakeEngine()) is qwen
    assert compat.kv_geometry(qwen) == (2, 2, 16)


def test_foreign_package_with_our_name_fails_clearly(tmp_path):
    fake = tmp_path / "instrumentation"
    fake.mkdir()
    (fake / "__init__.py").write_text("VERSION = 'someone else'\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        try:
            import rollout
        except ImportError as exc:
            print("ERR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "not opsd-rollout's `instrumentation` package" in out.stdout, out.stderr
