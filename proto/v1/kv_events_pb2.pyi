from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    all_cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
