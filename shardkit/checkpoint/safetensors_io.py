"""Full weights as safetensors, split into files of bounded size with an HF-style index, written tensor by tensor.

Every file's header is fixed up front from names, shapes and dtypes, so tensors can be written in any
order as they are gathered and no more than one tensor (or unit) is ever held in memory. The bytes are
the safetensors format as defined by the safetensors project; ``safetensors.torch.load_file`` reads them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import manifest as mf
from .errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# In the order the safetensors library lays tensors out (its Dtype enum, descending), which keeps
# every tensor aligned and makes our files byte-identical to safetensors.torch.save_file's.
_DTYPES = {torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
           torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.uint16: "U16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3",
           torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPES)}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from 123, '500MB' (powers of 10, like HF) or '2GiB' (powers of 2)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size {size!r} is not a size; use bytes or e.g. '500MB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass
class _File:
    name: str
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # absolute byte offset of each tensor
    header: bytes = b""
    size: int = 0


class SafetensorsLayout:
    """Which file each tensor goes to and where its bytes live, decided before any tensor is written."""

    def __init__(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        limit = parse_size(max_shard_size)
        groups: list[list] = [[]]
        used = 0
        for name, shape, dtype in tensors:
            if dtype not in _DTYPES:
                raise CheckpointError(f"{name}: safetensors cannot store dtype {dtype}")
            nbytes = _nbytes(shape, dtype)
            if groups[-1] and used + nbytes > limit:
                groups.append([])
                used = 0
            groups[-1].append((name, tuple(shape), dtype))
            used += nbytes
        n = len(groups)
        self.files = [_File(SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", g)
                      for i, g in enumerate(groups)]
        self.file_of: dict[str, _File] = {}
        for f in self.files:
            self._lay_out(f)
            for name, _, _ in f.tensors:
                self.file_of[name] = f
        self.total_size = sum(_nbytes(s, d) for _, s, d in tensors)

    @staticmethod
    def _lay_out(f: _File) -> None:
        order = sorted(f.tensors, key=lambda t: (_RANK[t[2]], t[0]))
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        rel = {}
        for name, shape, dtype in order:
            end = pos + _nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, end]}
            rel[name] = pos
            pos = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        f.header = struct.pack("<Q", len(text)) + text
        f.offsets = {name: len(f.header) + off for name, off in rel.items()}
        f.size = len(f.header) + pos

    def create(self, directory: str) -> None:
        """Write every file's header and size it; tensor bytes follow through `write`."""
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
        os.makedirs(directory, exist_ok=True)
        for f in self.files:
            with open(os.path.join(directory, f.name), "wb") as out:
                out.write(f.header)
                out.truncate(f.size)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {name: f.name for f in self.files for name, _, _ in f.tensors}}
            with open(os.path.join(directory, INDEX_FILE), "w") as out:
                json.dump(index, out, indent=2)

    def write(self, directory: str, name: str, tensor: torch.Tensor) -> None:
        """Put one tensor's bytes in place (its shape and dtype must be the declared ones)."""
        f = self.file_of[name]
        _, shape, dtype = next(t for t in f.tensors if t[0] == name)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"declared {shape} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        with open(os.path.join(directory, f.name), "r+b") as out:
            out.seek(f.offsets[name])
            data.tofile(out)

    def finish(self, directory: str) -> None:
        """Flush every file to disk."""
        for name in [f.name for f in self.files] + ([INDEX_FILE] if len(self.files) > 1 else []):
            with open(os.path.join(directory, name), "rb+") as out:
                os.fsync(out.fileno())
        mf.fsync_dir(directory)


CONFIG_FILES = ("config.json", "generation_config.json")  # export() writes a model's own


def is_weights_dir(path: str) -> bool:
    """True for a directory holding only what export() writes (or nothing)."""
    return all(name.endswith(".safetensors") or name in (INDEX_FILE, *CONFIG_FILES)
               for name in os.listdir(path))


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


# Reads a full tensor's dim-0 rows [start, stop) by name; (name, None) reads the whole tensor.
RowReader = Callable[[str, "tuple[int, int] | None"], torch.Tensor]


def read_full_source(source: Any) -> tuple[dict[str, tuple], RowReader]:
    """Open a full state dict (dict, safetensors file or dir, torch file): (name -> shape, read).

    `read(name, (start, stop))` returns only those rows of dim 0: from safetensors files only
    their bytes are read (a slice of the file), from a torch file mapped into memory only their
    pages; `read(name, None)` returns the whole tensor.
    """
    if isinstance(source, dict):
        return {k: tuple(v.shape) for k, v in source.items()}, _rows_of_mapping(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            raise CheckpointError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        return _open_safetensors([os.path.join(path, f) for f in files])
    if path.endswith(".safetensors"):
        return _open_safetensors([path])
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # name the file whatever torch refused
        raise CheckpointError(f"{path}: cannot load as a weights-only torch state dict ({exc})") from exc
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: holds a {type(sd).__name__}, not a state dict")
    return {k: tuple(v.shape) for k, v in sd.items()}, _rows_of_mapping(sd)


def _rows_of_mapping(tensors: dict) -> RowReader:
    def read(name: str, span: tuple[int, int] | None) -> torch.Tensor:
        tensor = tensors[name]
        return tensor if span is None else tensor[span[0]:span[1]]
    return read


def _open_safetensors(paths: list[str]) -> tuple[dict[str, tuple], RowReader]:
    from safetensors import safe_open

    handles, shapes = {}, {}
    for p in paths:
        try:
            h = safe_open(p, framework="pt")
            for k in h.keys():
                handles[k] = h
                shapes[k] = tuple(h.get_slice(k).get_shape())
        except Exception as exc:
            raise CheckpointError(f"{p}: not a readable safetensors file ({exc})") from exc

    def read(name: str, span: tuple[int, int] | None) -> torch.Tensor:
        if span is None:
            return handles[name].get_tensor(name)
        return handles[name].get_slice(name)[span[0]:span[1]]
    return shapes, read
