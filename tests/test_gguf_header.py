"""rollout.model.gguf_header: a GGUF's metadata from its header alone, on files written by the ``gguf`` package's own
writer (the real model's file: tests/test_real_model.py)."""

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from rollout.model.gguf_header import ARRAY, SCALAR_FORMATS, STRING, read_metadata  # noqa: E402


def test_the_value_types_are_ggufs():
    T = gguf.GGUFValueType
    assert (STRING, ARRAY) == (T.STRING, T.ARRAY)
    sizes = {T.UINT8: 1, T.INT8: 1, T.UINT16: 2, T.INT16: 2, T.UINT32: 4, T.INT32: 4, T.FLOAT32: 4, T.BOOL: 1,
             T.UINT64: 8, T.INT64: 8, T.FLOAT64: 8}
    assert {int(t): struct.calcsize(SCALAR_FORMATS[int(t)]) for t in sizes} == {int(t): n for t, n in sizes.items()}
    assert set(SCALAR_FORMATS) | {STRING, ARRAY} == {int(t) for t in T}


def _write(path, arch="llama"):
    """Arrays of strings and numbers before the numbers asked for, a tensor after them."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_context_length(4096)
    writer.add_block_count(2)
    writer.add_string("test.text", "h\u00e9")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_reads_the_keys_asked_for_past_arrays_it_skips(tmp_path):
    path = _write(tmp_path / "m.gguf")
    assert read_metadata(path, ["general.architecture", "llama.context_length", "llama.block_count", "test.text",
                                "missing.key"]) == {"general.architecture": "llama", "llama.context_length": 4096,
                                                    "llama.block_count": 2, "test.text": "h\u00e9"}
    assert read_metadata(path, ["tokenizer.ggml.tokens", "test.ints"]) == {"tokenizer.ggml.tokens": ["a", "bb", "ccc"],
                                                                         "test.ints": [1, 2, 3]}


def test_stops_reading_once_it_has_every_key(tmp_path):
    path = _write(tmp_path / "m.gguf")
    data = open(path, "rb").read()
    cut = data.index(b"llama.block_count") + 40  # the file ends after the keys asked for: not read
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    assert read_metadata(str(tmp_path / "cut.gguf"), ["llama.context_length"]) == {"llama.context_length": 4096}
    with pytest.raises(ValueError, match=r"cut.gguf: not a GGUF file \(it ends inside its header\)"):
        read_metadata(str(tmp_path / "cut.gguf"), ["test.text"])


@pytest.mark.parametrize("head, message", [
    (b"GGML" + struct.pack("<I", 3), r"not a GGUF file \(no GGUF magic\)"),
    (b"GGUF" + struct.pack("<I", 1), r"GGUF version 1 is not supported"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40), r"a string of 1099511627776 bytes"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), r"value type 99"),
    (b"", r"no GGUF magic"),
])
def test_files_that_are_not_gguf_are_refused_naming_the_file(tmp_path, head, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(head)
    with pytest.raises(ValueError, match=rf"bad.gguf: .*{message}"):
        read_metadata(str(path), ["llama.context_length"])
