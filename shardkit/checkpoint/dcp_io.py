"""Sharded checkpoint I/O through torch.distributed.checkpoint (DCP), one block of whole rows per rank and tensor.

The engine shards every parameter by rows of its first dimension, so each rank's piece of a
checkpoint entry is a rectangular chunk of the full tensor (rows ``[start, stop)``, every column):
exactly what FSDP2 writes for its ``Shard(0)`` DTensors. The folder is therefore one that torch's
own ``dcp.load`` reads into FSDP2's state dicts, and DCP's resharding serves any other split at
load time. Checkpoints of format 1 stored the same bytes as 1-D tensors of the flattened
parameter; a chunk built with the flattened shape reads them.

What only rank 0 writes beside its chunks: whole tensors (buffers, an optimizer's step counters)
and small Python values (an optimizer's param-group settings, as FSDP2's flattened optimizer state
dict holds them), the latter as DCP's pickled byte entries. shardkit never reads those back (it
keeps its own copy in its state file, loaded without unpickling code); they are there for torch.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from typing_extensions import override

from .errors import CorruptCheckpointError

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class FlatChunk:
    """This rank's elements ``[offset, offset + local.numel())`` of a flattened tensor of shape
    ``full_shape``: whole rows of it wherever the shape has dimensions (a row block on disk).

    Or, where `block` is given ((offsets, sizes) per dimension), that rectangular block of the
    full tensor, `local` holding it row-major: a tensor-parallel parameter's piece (its
    data-parallel rows of TP's part), which whole rows cannot describe."""

    local: torch.Tensor  # 1-D; written from on save, read into (in place) on load
    offset: int
    full_shape: tuple[int, ...]
    block: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def full_numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.full_shape)

    def _block(self) -> tuple[list[int], list[int]]:
        if self.block is not None:
            offsets, sizes = self.block
            if math.prod(sizes) != self.local.numel():
                raise ValueError(f"a block of sizes {sizes} holds {math.prod(sizes)} elements, "
                                 f"the chunk {self.local.numel()}")
            return list(offsets), list(sizes)
        shape = list(self.full_shape)
        if not shape:
            return [], []
        row = math.prod(shape[1:])
        if row == 0 or self.full_numel == 0:  # an empty tensor: one empty chunk, the whole shape
            return [0] * len(shape), shape
        if self.offset % row or self.local.numel() % row:
            raise ValueError(f"elements [{self.offset}, {self.offset + self.local.numel()}) are "
                             f"not whole rows of a {tuple(shape)} tensor")
        return [self.offset // row] + [0] * (len(shape) - 1), [self.local.numel() // row] + shape[1:]

    def chunk_metadata(self) -> ChunkStorageMetadata:
        """The DCP chunk this piece occupies in the full tensor."""
        offsets, sizes = self._block()
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def shaped(self) -> torch.Tensor:
        """`local` viewed as its block of the full tensor (DCP narrows and copies into it)."""
        return self.local.view(self._block()[1])


@dataclass(frozen=True)
class SavedObject:
    """A small Python value rank 0 writes for torch's readers (DCP pickles it)."""

    value: Any


SaveItem = FlatChunk | SavedObject  # what save_chunks and write_rank take per key


def with_copies(items: dict[str, SaveItem],
                copy: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> dict[str, SaveItem]:
    """The same items with every chunk's tensor replaced by `copy` of it (one call for all:
    a backend's host copy or snapshot); objects are kept as they are."""
    chunks = {k: item for k, item in items.items() if isinstance(item, FlatChunk)}
    copies = copy([chunk.local for chunk in chunks.values()])
    return {**items, **{k: replace(chunk, local=c) for (k, chunk), c in zip(chunks.items(), copies)}}


class FlatChunkSavePlanner(DefaultSavePlanner):
    """Writes one DCP chunk per FlatChunk and one byte entry per SavedObject; dict keys are the
    checkpoint entry names."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    @override
    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per chunk of this rank, one BYTE_IO item per object."""
        items = []
        for key, entry in self.state_dict.items():
            if isinstance(entry, SavedObject):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            if not isinstance(entry, FlatChunk):
                raise TypeError(f"checkpoint entry {key!r} is {type(entry).__name__}, not "
                                "FlatChunk or SavedObject")
            chunk = entry.chunk_metadata()
            items.append(WriteItem(
                index=MetadataIndex(key, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(entry.local),
                    size=torch.Size(entry.full_shape))))
        self.plan = SavePlan(items)
        return self.plan

    @override
    def lookup_object(self, index: MetadataIndex) -> Any:
        """The block of rows (or the object) behind a write item."""
        entry = self.state_dict[index.fqn]
        return entry.value if isinstance(entry, SavedObject) else entry.shaped()


class FlatChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into FlatChunks whatever stored chunks overlap them (DCP's load-time resharding)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    @override
    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Keep the FlatChunk dict as is (no flattening, no meta-device materialisation)."""
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    @override
    def create_local_plan(self) -> LoadPlan:
        """Read items for the overlap of each local chunk with the stored chunks."""
        assert self.metadata is not None, "set_up_planner() gives the metadata first"
        items = []
        for key, chunk in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != chunk.full_shape:
                found = None if md is None else getattr(md, "size", type(md).__name__)
                raise CorruptCheckpointError(
                    f"checkpoint entry {key!r}: expected a tensor of shape {chunk.full_shape} "
                    f"in the DCP metadata, found {found}")
            if chunk.local.numel():
                items += create_read_items_for_chunk_list(key, md, [chunk.chunk_metadata()])
        return LoadPlan(items)

    @override
    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The block of rows a read item lands in (a view of the chunk's local tensor)."""
        return self.state_dict[index.fqn].shaped()

    @override
    def load_bytes(self, read_item, value) -> None:
        """Refuse pickled objects: shardkit checkpoints store only tensors in DCP."""
        raise CorruptCheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; shardkit never "
            "unpickles checkpoint objects")


# DCP's metadata file is a plain pickle; this allow-list is everything DCP's Metadata contains,
# so loading it cannot run arbitrary code.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
     ("builtins", "frozenset"), ("builtins", "slice"), ("copyreg", "_reconstructor"),
     ("builtins", "object"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    @override
    def find_class(self, module: str, name: str) -> Any:
        """Resolve only allow-listed DCP types and torch dtypes/layouts; refuse everything else."""
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled through an allow-list of DCP's own types."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Load ``.metadata`` without executing arbitrary pickled code."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            data = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as exc:  # any failure means the file is not DCP metadata
            raise CorruptCheckpointError(f"{path}: cannot read DCP metadata ({exc})") from exc
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def save_chunks(directory: str, chunks: dict[str, SaveItem], process_group: Any) -> None:
    """Collective: every rank writes its chunks (one file per rank) into `directory`."""
    dcp.save(chunks, storage_writer=FileSystemWriter(directory, single_file_per_rank=True,
                                                     sync_files=True),
             planner=FlatChunkSavePlanner(), process_group=process_group)


def load_chunks(directory: str, chunks: dict[str, FlatChunk], process_group: Any = None,
                no_dist: bool = False) -> None:
    """Fill each FlatChunk in place from the checkpoint in `directory` (collective unless no_dist)."""
    dcp.load(chunks, storage_reader=SafeFileSystemReader(directory),
             planner=FlatChunkLoadPlanner(), process_group=process_group, no_dist=no_dist)


class FlatTensorReader:
    """Offline, process-group-free reader of whole entries, one at a time (bounded memory)."""

    def __init__(self, directory: str) -> None:
        self.reader = SafeFileSystemReader(directory)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)

    def read(self, key: str) -> torch.Tensor:
        """Return the full tensor stored under `key`, assembled from every rank's chunks."""
        md = self.metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{key} is stored as {type(md).__name__}, not a tensor")
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        planner = FlatChunkLoadPlanner()
        planner.set_up_planner({key: FlatChunk(out.view(-1), 0, tuple(md.size))}, self.metadata,
                               True)
        self.reader.read_data(planner.create_local_plan(), planner).wait()
        return out
