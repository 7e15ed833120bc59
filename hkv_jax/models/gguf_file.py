"""A fast reader of GGUF files (llama.cpp's format): metadata as Python values, tensors as dequantized arrays.

``gguf.GGUFReader`` builds a numpy view per array element, which takes about
half a minute on Gemma's 262144-token vocabulary; this reader walks the header
with ``struct`` (well under a second) and maps tensor data straight from the
file. Dequantization (Q8_0, Q5_0, Q4_K, Q6_K, ...) is the ``gguf`` package's.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version, tensor count,
metadata count; the metadata key/value pairs; per tensor its name, dims
(fastest first), type and offset; then the data, aligned to
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

# Metadata value types: struct format of each scalar type; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: name, numpy shape (slowest dim first), GGML type id, byte offset in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict), ``tensors`` (list of ``TensorInfo``), ``array(info)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or later)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            ggml_type = self._u32()
            (offset,) = struct.unpack_from("<Q", buf, self._pos)
            self._pos += 8
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, s, t, start + o) for n, s, t, o in infos]

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._map, self._pos)
        self._pos += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        self._pos += 8
        s = self._map[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item = self._u32()
            (count,) = struct.unpack_from("<Q", self._map, self._pos)
            self._pos += 8
            if item in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[item]
                values = list(struct.unpack_from(f"<{count}{fmt}", self._map, self._pos))
                self._pos += count * struct.calcsize(fmt)
                return values
            return [self._value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown metadata type {vtype}")
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def array(self, info: TensorInfo) -> np.ndarray:
        """Tensor ``info`` as float32, dequantized, in numpy order (``shape``)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row = info.shape[-1]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = np.frombuffer(self._map, np.uint8, count=rows * row // block * type_size, offset=info.offset)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            out = raw.view(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
        else:
            out = gguf.quants.dequantize(raw.reshape(rows, row // block * type_size), qtype)
        return np.asarray(out, np.float32).reshape(info.shape)

    def iter_arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, float32 array)`` of every tensor, in file order."""
        for info in self.tensors:
            yield info.name, self.array(info)
