from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordedOp(_message.Message):
    __slots__ = ("seq_no", "checksum", "author", "first_offset", "last_offset", "log", "create", "link", "unlink", "write", "property")
    class Create(_message.Message):
        __slots__ = ("path",)
        PATH_FIELD_NUMBER: _ClassVar[int]
        path: str
        def __init__(self, path: _Optional[str] = ...) -> None: ...
    class Link(_message.Message):
        __slots__ = ("fnode", "path")
        FNODE_FIELD_NUMBER: _ClassVar[int]
        PATH_FIELD_NUMBER: _ClassVar[int]
        fnode: int
        path: str
        def __init__(self, fnode: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...
    class Write(_message.Message):
        __slots__ = ("fnode", "offset", "length")
        FNODE_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        LENGTH_FIELD_NUMBER: _ClassVar[int]
        fnode: int
        offset: int
        length: int
        def __init__(self, fnode: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    UNLINK_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    PROPERTY_FIELD_NUMBER: _ClassVar[int]
    seq_no: int
    checksum: int
    author: int
    first_offset: int
    last_offset: int
    log: str
    create: RecordedOp.Create
    link: RecordedOp.Link
    unlink: RecordedOp.Link
    write: RecordedOp.Write
    property: Property
    def __init__(self, seq_no: _Optional[int] = ..., checksum: _Optional[int] = ..., author: _Optional[int] = ..., first_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., log: _Optional[str] = ..., create: _Optional[_Union[RecordedOp.Create, _Mapping]] = ..., link: _Optional[_Union[RecordedOp.Link, _Mapping]] = ..., unlink: _Optional[_Union[RecordedOp.Link, _Mapping]] = ..., write: _Optional[_Union[RecordedOp.Write, _Mapping]] = ..., property: _Optional[_Union[Property, _Mapping]] = ...) -> None: ...

class Property(_message.Message):
    __slots__ = ("path", "content")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: str
    def __init__(self, path: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("author", "first_seq_no", "first_offset", "first_checksum", "last_seq_no", "last_offset", "log")
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    author: int
    first_seq_no: int
    first_offset: int
    first_checksum: int
    last_seq_no: int
    last_offset: int
    log: str
    def __init__(self, author: _Optional[int] = ..., first_seq_no: _Optional[int] = ..., first_offset: _Optional[int] = ..., first_checksum: _Optional[int] = ..., last_seq_no: _Optional[int] = ..., last_offset: _Optional[int] = ..., log: _Optional[str] = ...) -> None: ...

class FnodeSegments(_message.Message):
    __slots__ = ("fnode", "segments")
    FNODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    fnode: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, fnode: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class FSMHints(_message.Message):
    __slots__ = ("log", "live_nodes", "properties")
    LOG_FIELD_NUMBER: _ClassVar[int]
    LIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    log: str
    live_nodes: _containers.RepeatedCompositeFieldContainer[FnodeSegments]
    properties: _containers.RepeatedCompositeFieldContainer[Property]
    def __init__(self, log: _Optional[str] = ..., live_nodes: _Optional[_Iterable[_Union[FnodeSegments, _Mapping]]] = ..., properties: _Optional[_Iterable[_Union[Property, _Mapping]]] = ...) -> None: ...
