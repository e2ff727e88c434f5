"""rollout.zero: ZeRO-3 detection, gathering in both modes, lockstep flag; and the DeepSpeed harness.

DeepSpeed runs in subprocess workers (tests/ds_workers/zero_gather.py, 2 ranks over gloo on CPU);
the in-process tests cover the paths that need no DeepSpeed.
"""

import pytest
import torch
from tests.ds_util import run_worker

from rollout.testing import tiny_model
from rollout.model.zero import (GATHER_MODES, any_rank_busy, check_gather_mode, gathered, is_zero3, rank,
                          world_size)

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def zero3_worker():
    """One 2-rank ZeRO-3 worker run: per rank, observations for each ``gathered`` target."""
    return [r.result for r in run_worker("zero_gather.py", world_size=WORLD_SIZE)]


@pytest.fixture(params=["engine", "module"])
def zero3_run(request, zero3_worker):
    """(target, per-rank observations) where ``gathered`` got the engine or the bare module."""
    return request.param, [per_rank[request.param] for per_rank in zero3_worker]


def test_zero3_engine_really_partitions(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:
        assert obs["num_params"] > 0
        # Outside any gather every parameter's data is empty and its shard is 1/world of it.
        assert obs["outside_before"] == {"num_full": 0, "num_empty": obs["num_params"], "shards_ok": True}


def test_gathered_once_keeps_full_params_across_forwards(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:
        full = {"num_full": obs["num_params"], "num_empty": 0, "shards_ok": True}
        assert obs["inside_once"] == full
        assert obs["inside_once_after_forwards"] == full
        assert obs["once_diffs"] == [0.0, 0.0, 0.0]  # bit-identical to the unwrapped model
        assert obs["once_engine_forward_diff"] == 0.0  # also through DeepSpeedEngine.forward


def test_gathered_once_repartitions_and_training_still_works(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:
        assert obs["outside_after"]["num_empty"] == obs["num_params"]
        assert obs["hooks_after_once"] == obs["hooks_outside"]
        assert obs["hooked_diff_between"] == 0.0  # ZeRO-3's own gathering works again
        assert obs["outside_end"]["num_empty"] == obs["num_params"]
        assert obs["train_loss_finite"]


def test_gathered_once_suspends_zero3_hooks_only_given_the_engine(zero3_run):
    target, per_rank = zero3_run
    for obs in per_rank:
        if target == "engine":
            assert obs["hooks_inside_once"] < obs["hooks_outside"]
        else:
            assert obs["hooks_inside_once"] == obs["hooks_outside"]


def test_per_forward_mode_leaves_params_partitioned(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:
        assert obs["inside_per_forward"]["num_empty"] == obs["num_params"]
        assert obs["per_forward_diff"] == 0.0


def test_is_zero3_on_engine_module_and_plain_model(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:
        assert obs["is_zero3"] == [True, True, False]


def test_any_rank_busy_agrees_across_ranks(zero3_run):
    _, per_rank = zero3_run
    for obs in per_rank:  # rank 1 is idle in "only_rank0" yet must keep stepping
        assert obs["busy"] == {"only_rank0": True, "none": False, "all": True}


@pytest.mark.parametrize("mode", ["", "all", "ONCE", None, "per-forward"])
def test_bad_gather_mode_names_gather(mode):
    with pytest.raises(ValueError, match="gather"):
        check_gather_mode(mode)
    with pytest.raises(ValueError, match="gather"):
        with gathered(tiny_model(), mode):
            pass


@pytest.mark.parametrize("mode", GATHER_MODES)
def test_gathered_is_a_noop_for_plain_models(mode):
    model = tiny_model()
    before = {name: (p.data_ptr(), p._version) for name, p in model.named_parameters()}
    with gathered(model, mode):
        inside = {name: (p.data_ptr(), p._version) for name, p in model.named_parameters()}
    assert inside == before
    assert not is_zero3(model)


def test_is_zero3_rejects_non_modules():
    with pytest.raises(TypeError, match="module_or_engine"):
        is_zero3(object())


@pytest.mark.parametrize("local_busy", [True, False])
def test_any_rank_busy_without_distributed_returns_local(local_busy):
    assert not torch.distributed.is_initialized()
    assert any_rank_busy(local_busy, "cpu") is local_busy
    assert (world_size(), rank()) == (1, 0)


def test_harness_passes_rank_env_and_returns_results():
    code = ("import os, sys; from common import emit; "
            "emit({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'DS_ACCELERATOR')}"
            " | {'argv': sys.argv[1:], 'port': os.environ['MASTER_PORT']})")
    results = run_worker(code, "a", 7, world_size=2, timeout=60)
    assert [r.result["RANK"] for r in results] == ["0", "1"]
    for r in results:
        assert r.result["WORLD_SIZE"] == "2" and r.result["DS_ACCELERATOR"] == "cpu"
        assert r.result["LOCAL_RANK"] == r.result["RANK"] and r.result["argv"] == ["a", "7"]
    assert results[0].result["port"] == results[1].result["port"]


def test_harness_fails_the_test_with_the_failing_rank_stderr():
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    sys.exit('rank one broke')\n"
            "time.sleep(60)\n")  # rank 0 would hang in a collective: the harness must kill it
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1 exited with status 1.*rank one broke"):
        run_worker(code, world_size=2, timeout=30)


def test_harness_timeout_and_missing_result_fail():
    with pytest.raises(pytest.fail.Exception, match="timed out after 1 s"):
        run_worker("import time; time.sleep(30)", timeout=1)
    with pytest.raises(pytest.fail.Exception, match="emitted no result"):
        run_worker("print('hello')", timeout=30)
    with pytest.raises(FileNotFoundError, match="no_such_worker.py"):
        run_worker("no_such_worker.py")
