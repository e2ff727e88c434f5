"""Shared fixtures: tiny random models (no downloads) and an HF ``generate`` oracle."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("OPSD_PROFILE", "0")  # tests opt in to profiling explicitly
if "OPSD_REAL_MODEL_CACHE" not in os.environ:  # the real model's conversion: this process's own, not the user's
    os.environ["OPSD_REAL_MODEL_CACHE"] = tempfile.mkdtemp(prefix="opsd-real-model-")
    atexit.register(shutil.rmtree, os.environ["OPSD_REAL_MODEL_CACHE"], True)
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through its interpreter (tests/test_fused_nucleus.py). It must be
    # set before triton is imported: triton's own library functions are made interpreted at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout.testing import TinyTokenizer, random_prompts, tiny_model  # noqa: E402


def _share_the_cores() -> None:
    """Under pytest-xdist, each test process gets its share of the cores for torch's threads, and so do the processes
    a test starts (``OMP_NUM_THREADS`` unless set): on 2 cores, two test processes of two threads each took
    test_real_model.py 212 s against 106 s with one thread each (2026-12-05)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


_share_the_cores()


@pytest.fixture(scope="session")
def qwen():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama", seed=1)


def hf_greedy(model, ids_row: torch.Tensor, mask_row: torch.Tensor, max_new_tokens: int, *, eos=None, pad=0,
              repetition_penalty: float = 1.0) -> list[int]:
    """Response tokens of HF ``generate`` on one prompt alone, greedy, fp32. The row's left padding is cut (a prompt
    alone has none; a masked hole after its first token stays): transformers 5.17 counts a left-padded row's pad ids in
    the repetition history where 5.24 does not, and without padding both give the prompt's own tokens."""
    first = int(mask_row.nonzero()[0])
    ids_row, mask_row = ids_row[first:], mask_row[first:]
    out = model.generate(ids_row[None], attention_mask=mask_row[None], max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, eos_token_id=eos,
                         repetition_penalty=repetition_penalty, temperature=None, top_p=None, top_k=None)
    return out[0, ids_row.shape[0]:].tolist()


def response_of(batch, row: int) -> list[int]:
    """The masked response tokens of one output row."""
    start = int(batch.response_start_idx[row])
    keep = batch.attention_mask[row, start:].bool()
    return batch.input_ids[row, start:][keep].tolist()


def assert_setting_keeps_hf_greedy(family: str, route: str, setting: str, *, seed: int, prompt_seed: int) -> None:
    """A tiny ``family`` model decoded greedily (fp32, 4 prompts, 7 new tokens, no EOS) on ``route`` with the
    ``RolloutConfig.kernels`` field ``setting`` on and off: the same tokens, and each row HF ``generate``'s."""
    from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig

    model = tiny_model(family, seed=seed)
    ids, mask = random_prompts(4, 9, seed=prompt_seed, vocab_size=model.config.vocab_size, min_len=2)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.0, continuous_batch_size=2)
    no_eos = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    runs = {flag: Rollout(model, no_eos, RolloutConfig(route=route, kernels=KernelConfig(**{setting: flag})))
            .generate(RolloutRequest(ids, mask), sampling) for flag in (True, False)}
    assert torch.equal(runs[True].input_ids, runs[False].input_ids)
    for row in range(ids.shape[0]):
        assert response_of(runs[True], row) == hf_greedy(model, ids[row], mask[row], 7)


__all__ = ["TinyTokenizer", "random_prompts", "hf_greedy", "response_of", "assert_setting_keeps_hf_greedy"]


def needs_cuda(reason: str) -> bool:
    """Whether a ``skipif`` reason says its test needs CUDA ("needs CUDA", "needs a CUDA device", "pinned host memory
    needs CUDA"). A reason that only mentions CUDA does not count: the interpreter-only tests skip on a GPU because
    "tests/conftest.py sets it without CUDA", and matching that word made ``-m gpu`` on an H100 select 11 of them,
    which then skipped there (2026-12-06)."""
    return re.search(r"\bneeds (a )?cuda\b", reason.lower()) is not None


def pytest_collection_modifyitems(config, items):
    """Mark every test skipped without CUDA as ``gpu``: ``pytest -m gpu tests`` is the GPU selection."""
    for item in items:
        if any(needs_cuda(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)


def counter(calls: dict):
    """``counted(name, fn)``: ``fn`` wrapped so that each call adds 1 to ``calls[name]`` (pieces a test counts)."""
    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    return counted


def with_step_pieces(ro, **pieces) -> None:
    """From now on ``ro``'s step parts carry ``pieces`` (``StepFns`` fields, e.g. an interpreted kernel or a
    counting wrapper) in place of what its config chose."""
    import dataclasses

    build = ro.runner.fast_step.parts

    def parts(device, mirrored):
        got = build(device, mirrored)
        return dataclasses.replace(got, fns=dataclasses.replace(got.fns, **pieces))

    ro.runner.fast_step.parts = parts
