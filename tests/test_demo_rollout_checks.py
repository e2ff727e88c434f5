"""``scripts/demo_rollout.py`` checks every flag before it builds the model, as the main job does (issue 34): a bad
value exits with status 2 naming the flag; lengths past the model's context and rows past the host's memory exit
with one ``error: --flag ...`` line."""

import re

import pytest

from rollout.opsd import preflight
from scripts import demo_rollout

GIB = 2**30


def _no_build(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(demo_rollout, "tiny_model", no_build)


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "0"], r"--prompt-len: must be an int >= 1; got 0"),
    (["--prompt-len", "-3"], r"--prompt-len: must be an int >= 1; got -3"),
    (["--batch-size", "0"], r"--batch-size: must be an int >= 1; got 0"),
    (["--batch-size", "-1"], r"--batch-size: must be an int >= 1; got -1"),
    (["--samples", "0"], r"--samples: must be an int >= 1; got 0"),
    (["--max-new-tokens", "0"], r"--max-new-tokens: must be a positive int; got 0"),
    (["--max-new-tokens", "-5"], r"--max-new-tokens: must be a positive int; got -5"),
    (["--temperature", "nan"], r"--temperature: must be a finite number; got nan"),
    (["--temperature", "inf"], r"--temperature: must be a finite number; got inf"),
    (["--temperature=-inf"], r"--temperature: must be a finite number; got -inf"),
])
def test_bad_values_exit_2_naming_the_flag(monkeypatch, capsys, argv, message):
    _no_build(monkeypatch)
    with pytest.raises(SystemExit) as info:
        demo_rollout.main(argv)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"\S+: error: {message}", last)


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "600"], "--prompt-len 32 + --max-new-tokens 600 = 632 exceeds the model's context of 512 "
                                  "tokens (max_position_embeddings of the embedded tiny qwen2 model)"),
    (["--prompt-len", "500"], "--prompt-len 500 + --max-new-tokens 32 = 532 exceeds the model's context of 512"),
    (["--prompt-len", str(10**12), "--max-new-tokens", "1"], f"--prompt-len {10**12} + --max-new-tokens 1 = "),
])
def test_lengths_past_the_context_are_refused_before_building(monkeypatch, argv, message):
    _no_build(monkeypatch)
    with pytest.raises(SystemExit) as info:
        demo_rollout.main(argv)
    assert str(info.value.code).startswith(f"error: {message}") and "\n" not in str(info.value.code)


@pytest.mark.parametrize("argv, rows", [(["--samples", str(10**8)], 4 * 10**8),
                                        (["--batch-size", str(10**8), "--samples", "1"], 10**8)])
def test_rows_past_the_hosts_memory_are_refused_before_building(monkeypatch, argv, rows):
    _no_build(monkeypatch)
    monkeypatch.setattr(preflight, "available_bytes", lambda device_type: 8 * GIB)
    with pytest.raises(SystemExit) as info:
        demo_rollout.main(argv)
    message = str(info.value.code)
    assert re.match(rf"error: --batch-size \d+ x --samples \d+ = {rows} rows: the rollout needs at least ", message)
    assert message.endswith("but the host has 8 GiB available")


def test_a_one_token_prompt_runs(capsys):
    """Rows were drawn from ``[prompt_len // 2, prompt_len]``: some had no token at ``--prompt-len 1``."""
    demo_rollout.main(["--prompt-len", "1", "--max-new-tokens", "2", "--batch-size", "4", "--samples", "1"])
    assert "prompts      (4, 1)  (left-padded, lengths [1, 1, 1, 1])" in capsys.readouterr().out
