"""Tensors that captured decode graphs read must outlive the call that captured them.

A CUDA graph reads its inputs at the addresses they had at capture. The ordinary route's graphs are
kept across calls (same shapes, same EOS ids); each call used to bring a new EOS-id tensor while the
replays read the first call's, freed after that call, so from the second call on rows did not finish in
graph replays (found on the H200, 2026-12-01). Here the graph path runs on the CPU with the replay
simulated by running the step (the path, the keys and the buffers are the GPU's), and the test checks
what a replay depends on: every call's steps get the one EOS tensor the executor keeps per EOS set.
"""

from __future__ import annotations

import pytest
import torch

import rollout.executors.runner as runner_module
import rollout.executors.ordinary.executor as executor_module
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.executors.decode import DecodeChoice
from rollout.executors.graphs import GRAPH, GraphSet
from rollout.testing import TinyTokenizer, random_prompts, tiny_model


@pytest.fixture
def graph_path_on_cpu(monkeypatch):
    """The graph decode path on the CPU: ``replay`` runs the step (no capture) and reports a graph step;
    every ``decode_step`` call's EOS tensor is recorded."""
    monkeypatch.setattr(runner_module, "choose_decode",
                        lambda config, model, is_zero3, device, fused=(): DecodeChoice("graph", None, "packed"))
    monkeypatch.setattr(GraphSet, "replay", lambda self, key, work, mutable: (work(), GRAPH)[1])
    seen = []
    real = executor_module.decode_step

    def recording(parts, cache, bufs, shape, sampler, eos_ids, **kwargs):
        seen.append(eos_ids)
        return real(parts, cache, bufs, shape, sampler, eos_ids, **kwargs)

    monkeypatch.setattr(executor_module, "decode_step", recording)
    return seen


def test_every_call_reads_the_eos_tensor_its_graphs_were_captured_with(graph_path_on_cpu):
    model = tiny_model("qwen2", seed=0)
    ids, mask = random_prompts(4, 6, seed=1, vocab_size=model.config.vocab_size)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=[5, 7]), RolloutConfig(route="ordinary"))
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    first = ro.generate(RolloutRequest(ids, mask), sampling)
    assert ro.last_stats.decode.path == "graph"
    calls_first = len(graph_path_on_cpu)
    second = ro.generate(RolloutRequest(ids, mask), sampling)
    assert torch.equal(first.input_ids, second.input_ids)
    kept = ro.runner.executors["ordinary"].eos_tensors[(5, 7)]
    assert calls_first > 0 and len(graph_path_on_cpu) > calls_first
    assert all(t is kept for t in graph_path_on_cpu)  # the same object, hence the same address, every call
    assert kept.tolist() == [5, 7]


def test_another_eos_set_gets_its_own_tensor_and_release_drops_them(graph_path_on_cpu):
    model = tiny_model("qwen2", seed=0)
    ids, mask = random_prompts(3, 5, seed=2, vocab_size=model.config.vocab_size)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    a = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=[5]), RolloutConfig(route="ordinary"))
    a.generate(RolloutRequest(ids, mask), sampling)
    a.eos_token_ids = (9,)  # as a tokenizer with another EOS set would give
    a.generate(RolloutRequest(ids, mask), sampling)
    assert set(a.runner.executors["ordinary"].eos_tensors) == {(5,), (9,)}
    assert a.runner.executors["ordinary"].eos_tensors[(9,)].tolist() == [9]
    a.shutdown()
    assert a.runner.executors["ordinary"].eos_tensors == {}
