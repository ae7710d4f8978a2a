from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupRequest(_message.Message):
    __slots__ = ("token", "worker", "iteration")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    token: str
    worker: int
    iteration: int
    def __init__(self, token: _Optional[str] = ..., worker: _Optional[int] = ..., iteration: _Optional[int] = ...) -> None: ...

class GroupReply(_message.Message):
    __slots__ = ("seq", "members")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    members: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("token", "worker")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    token: str
    worker: int
    def __init__(self, token: _Optional[str] = ..., worker: _Optional[int] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupReply]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupReply, _Mapping]]] = ...) -> None: ...

class ExcludeRequest(_message.Message):
    __slots__ = ("token", "worker")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    token: str
    worker: int
    def __init__(self, token: _Optional[str] = ..., worker: _Optional[int] = ...) -> None: ...

class ExcludeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("token", "path")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    token: str
    path: str
    def __init__(self, token: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class TraceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
