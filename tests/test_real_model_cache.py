"""The real model's conversion kept between processes (``rollout.real_model.cache_folder``), on a tiny Llama and a
word-level tokenizer standing in for the GGUF's (the real model's equivalence with its GGUF: tests/test_real_model.py).
A second process loads the folder without reading the GGUF; the folder's key follows the file and the transformers
version; a folder another process wrote first stays; an unwritable or damaged cache falls back to the GGUF with a
warning naming ``OPSD_REAL_MODEL_CACHE``, which turns the cache off."""

from __future__ import annotations

import os

import pytest
import torch

from rollout import real_model
from rollout.testing import tiny_model


class FakeGGUF:
    """``gguf_model`` / ``gguf_tokenizer`` stand-ins that count their reads."""

    def __init__(self):
        self.model, self.reads = tiny_model("llama", seed=1).eval(), []

    def read_model(self, dtype):
        self.reads.append(("model", dtype))
        return tiny_model("llama", seed=1).to(dtype).eval()

    def read_tokenizer(self):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        self.reads.append(("tokenizer", None))
        words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "</s>": 3}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="</s>")


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file and reads, the cache under ``tmp_path/cache``, the per-process caches empty before and
    after (no other test may get the tiny model)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    fake = FakeGGUF()
    monkeypatch.setattr(real_model, "gguf_path", lambda: str(path))
    monkeypatch.setattr(real_model, "gguf_model", fake.read_model)
    monkeypatch.setattr(real_model, "gguf_tokenizer", fake.read_tokenizer)
    monkeypatch.setenv(real_model.CACHE_ENV, str(tmp_path / "cache"))
    fake.path = path
    _forget()
    yield fake
    _forget()


def _forget():
    real_model._pristine_model.cache_clear()
    real_model._gguf_tokenizer.cache_clear()


def _same_weights(model, expected) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), expected.state_dict().values()))


def test_a_second_process_loads_the_conversion_without_reading_the_gguf(gguf):
    first = real_model._pristine_model(torch.float32)
    assert gguf.reads == [("model", torch.float32)] and _same_weights(first, gguf.model)
    folder = real_model.cache_folder()
    assert sorted(os.listdir(folder)) == ["model"]  # no staging folder left
    _forget()  # as a new process
    assert _same_weights(real_model._pristine_model(torch.float32), gguf.model)
    bf16 = real_model._pristine_model(torch.bfloat16)
    assert _same_weights(bf16, gguf.model.to(torch.bfloat16)) and bf16.dtype == torch.bfloat16
    assert real_model._gguf_tokenizer()("a b c")["input_ids"] == [0, 1, 2]
    _forget()
    assert real_model._gguf_tokenizer().eos_token == "</s>"
    assert gguf.reads == [("model", torch.float32), ("tokenizer", None)]
    assert sorted(os.listdir(folder)) == ["model", "tokenizer"]


def test_the_folder_follows_the_file_and_the_transformers_version(gguf, monkeypatch, tmp_path):
    import transformers

    folder = real_model.cache_folder()
    assert os.path.dirname(folder) == str(tmp_path / "cache") and os.path.basename(folder).startswith("smollm2-135m-")
    os.utime(gguf.path, ns=(1, 1))
    assert real_model.cache_folder() != folder
    moved = real_model.cache_folder()
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert real_model.cache_folder() not in (folder, moved)
    for off in ("0", "", " "):
        monkeypatch.setenv(real_model.CACHE_ENV, off)
        assert real_model.cache_folder() is None
    monkeypatch.delenv(real_model.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_model.cache_folder().startswith(str(tmp_path / "xdg" / "opsd" / "real-model" / "smollm2-135m-"))


def test_the_cache_off_reads_the_gguf_in_the_dtype_asked(gguf, monkeypatch, tmp_path):
    monkeypatch.setenv(real_model.CACHE_ENV, "0")
    model = real_model._pristine_model(torch.bfloat16)
    assert gguf.reads == [("model", torch.bfloat16)] and model.dtype == torch.bfloat16
    assert not (tmp_path / "cache").exists()


def test_a_folder_another_process_wrote_first_stays(gguf, tmp_path):
    folder = tmp_path / "cache" / "entry"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "theirs").write_text("x")
    real_model.convert(str(folder), "model", gguf.model)
    assert os.listdir(folder) == ["model"] and os.listdir(folder / "model") == ["theirs"]
    with pytest.raises(ValueError, match="part: must be one of"):
        real_model.convert(str(folder), "weights", gguf.model)


def test_an_unwritable_cache_reads_the_gguf_and_says_so(gguf, monkeypatch, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(real_model.CACHE_ENV, str(tmp_path / "file"))
    model = real_model._pristine_model(torch.float32)
    assert _same_weights(model, gguf.model) and gguf.reads == [("model", torch.float32)]  # read once, kept
    err = capsys.readouterr().err
    assert "warning: the real model's model is read from the GGUF" in err and "OPSD_REAL_MODEL_CACHE=0" in err
    _forget()
    assert real_model._pristine_model(torch.bfloat16).dtype == torch.bfloat16
    assert gguf.reads[1:] == [("model", torch.float32), ("model", torch.bfloat16)]  # .to() would cast the buffers


@pytest.mark.parametrize("damage", ["garbage", "empty", "missing"])
def test_a_damaged_cached_model_reads_the_gguf_and_says_so(gguf, capsys, damage):
    real_model._pristine_model(torch.float32)
    weights = os.path.join(real_model.cache_folder(), "model", "model.safetensors")
    if damage == "missing":
        os.remove(weights)
    else:
        with open(weights, "wb") as handle:
            handle.write(b"garbage" * 10 if damage == "garbage" else b"")
    _forget()
    assert _same_weights(real_model._pristine_model(torch.float32), gguf.model)
    assert gguf.reads == [("model", torch.float32)] * 2
    assert "its cache" in capsys.readouterr().err
