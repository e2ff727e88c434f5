"""The BLAS backend of a call (``RolloutConfig.kernels.blas_library``, ``rollout.executors.blas``): set for the call on
CUDA, the caller's restored after it (also when the call fails), nothing touched off CUDA or with None."""

from __future__ import annotations

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.executors import blas
from rollout.testing import TinyTokenizer, random_prompts, tiny_model


class Enum:
    """What torch's getter returns (``_BlasBackend.Cublas``); the setter takes it back as well as a name."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"_BlasBackend.{self.name.capitalize()}"


class FakeBackend:
    """Stands in for ``torch.backends.cuda.preferred_blas_library`` (a CPU build cannot select cuBLASLt).
    ``value``: the backend now; ``sets``: every backend set, in order."""

    def __init__(self, initial="cublas", refuse=()):
        self.value, self.refuse, self.sets = initial, refuse, []

    def __call__(self, backend=None):
        if backend is not None:
            name = backend.name if isinstance(backend, Enum) else backend
            if name in self.refuse:
                raise RuntimeError(f"Cannot set preferred backend to {name}")
            self.sets.append(name)
            self.value = name
        return Enum(self.value)


@pytest.fixture
def fake(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", backend)
    return backend


def test_cuda_call_sets_the_backend_and_restores_the_callers(fake):
    with blas.blas_library("cublaslt", torch.device("cuda")) as in_effect:
        assert in_effect == "cublaslt" and fake.value == "cublaslt"
    assert fake.value == "cublas"
    assert fake.sets == ["cublaslt", "cublas"]  # set, then the caller's put back


def test_the_callers_backend_comes_back_when_the_block_fails(fake):
    with pytest.raises(ZeroDivisionError):
        with blas.blas_library("cublaslt", torch.device("cuda")):
            assert fake.value == "cublaslt"
            1 / 0
    assert fake.value == "cublas"


def test_none_and_the_same_backend_change_nothing(fake):
    with blas.blas_library(None, torch.device("cuda")) as in_effect:
        assert in_effect == "cublas"
    with blas.blas_library("cublas", torch.device("cuda")) as in_effect:
        assert in_effect == "cublas"
    assert fake.sets == [] and fake.value == "cublas"


def test_a_backend_the_build_lacks_keeps_the_current_one_and_says_why(monkeypatch):
    backend = FakeBackend(refuse=("cublaslt",))
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", backend)
    with blas.blas_library("cublaslt", torch.device("cuda")) as in_effect:
        assert in_effect.startswith("cublas (cublaslt unavailable: ") and backend.value == "cublas"
    assert backend.sets == []


def test_off_cuda_nothing_is_touched(fake):
    with blas.blas_library("cublaslt", torch.device("cpu")) as in_effect:
        assert in_effect == ""
    assert fake.sets == []


def test_config_default_and_call_stats_on_the_cpu(fake):
    assert RolloutConfig().kernels.blas_library == "cublaslt"
    ids, mask = random_prompts(2, 5, seed=1)
    ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(eos_token_id=None), RolloutConfig())
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert ro.last_stats.blas_library == "" and fake.sets == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("asked", ["cublaslt", "cublas", None])
def test_cuda_call_runs_on_the_asked_backend_and_restores_the_callers(asked):
    torch.backends.cuda.preferred_blas_library("cublas")
    model = tiny_model("qwen2", seed=0).cuda()
    ids, mask = random_prompts(3, 6, seed=2)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(kernels=KernelConfig(blas_library=asked)))
    ro.generate(RolloutRequest(ids.cuda(), mask.cuda()), SamplingConfig(max_new_tokens=3, temperature=0.0))
    assert ro.last_stats.blas_library == (asked or "cublas")
    assert blas.current() == "cublas"
