"""The metadata of a GGUF file, read from its header only (pure file I/O, standard library only).

transformers reads a GGUF's config through ``gguf.GGUFReader``, which maps every tensor's description as well:
about 4 s for the 93 MB SmolLM2 file on a 2-core host. The checks before a job builds its models need a handful of
numbers (context length, widths, vocabulary), which come first in the file: :func:`read_metadata` reads key-value
pairs in order and stops once it has the keys asked for (a few milliseconds). Layout (GGUF v2 and v3): ``b"GGUF"``,
``uint32`` version, ``uint64`` tensor count, ``uint64`` key-value count, then per pair a string key (``uint64``
length + UTF-8 bytes), a ``uint32`` value type and the value (an array: ``uint32`` element type, ``uint64`` count,
the elements). Little-endian files only (the byte order GGUF writers use by default). The value types are the
format's (``gguf.GGUFValueType`` numbers them the same way; tests/test_gguf_header.py checks it).
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Iterable

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: Bytes a key or string may take before the file is called corrupt (the longest real ones are chat templates).
MAX_STRING_BYTES = 1 << 24


#: GGUF value type -> struct format of its fixed-size scalars (the format's numbering; 8 = string, 9 = array).
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
STRING, ARRAY = 8, 9


class _Reader:
    def __init__(self, f: BinaryIO, path: str):
        self.f, self.path = f, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError(f"{self.path}: not a GGUF file (it ends inside its header)")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        size = self.take("<Q")
        if size > MAX_STRING_BYTES:
            raise ValueError(f"{self.path}: not a GGUF file (a string of {size} bytes in its header)")
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError(f"{self.path}: not a GGUF file (it ends inside its header)")
        return data.decode("utf-8", errors="replace")

    def value_type(self) -> int:
        code = self.take("<I")
        if code not in SCALAR_FORMATS and code not in (STRING, ARRAY):
            raise ValueError(f"{self.path}: not a GGUF file (value type {code} in its header)")
        return code

    def value(self, kind, keep: bool):
        """The value of type ``kind``; arrays are skipped (None) unless ``keep``."""
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            return self.take(SCALAR_FORMATS[kind])
        element, count = self.value_type(), self.take("<Q")
        if not keep and element in SCALAR_FORMATS:  # fixed-size elements: one seek
            self.f.seek(count * struct.calcsize(SCALAR_FORMATS[element]), 1)
            return None
        items = [self.value(element, keep) for _ in range(count)]
        return items if keep else None


def read_metadata(path: str, keys: Iterable[str]) -> dict:
    """``{key: value}`` of those of ``keys`` that the GGUF file at ``path`` holds, reading its key-value pairs in
    order until it has them all. ValueError naming the file when it is not a GGUF file of a known version;
    OSError when it cannot be read."""
    wanted, found = set(keys), {}
    with open(path, "rb") as f:
        reader = _Reader(f, path)
        if f.read(4) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        version = reader.take("<I")
        if version not in VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported (known: {VERSIONS})")
        reader.take("<Q")  # tensor count
        for _ in range(reader.take("<Q")):
            if len(found) == len(wanted):
                break
            key = reader.string()
            value = reader.value(reader.value_type(), keep=key in wanted)
            if key in wanted:
                found[key] = value
    return found
