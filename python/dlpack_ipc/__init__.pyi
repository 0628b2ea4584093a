# SPDX-License-Identifier: Apache-2.0
# The module defines a function named list, so inside this file the builtin type is
# builtins.list (and dict, for symmetry, builtins.dict).
import builtins
import enum
from typing import (Any, ContextManager, Iterator, Literal, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union, final)

__all__ = [
    "Client", "SharedTensor", "EntryInfo", "EntryFlags", "TensorInfo", "Owner", "publish",
    "publish_dict", "published", "published_dict", "attach", "attach_dict", "empty",
    "empty_dict", "unpublish", "list", "stat", "cuda_releases_held",
    "watch", "Watch", "WatchEvent", "channel", "channels", "Channel", "ChannelInfo",
    "ChannelClosed",
    "CHANNEL_CAPACITY_DEFAULT", "CHANNEL_CAPACITY_MAX",
]

NAME_MAX: int
NDIM_MAX: int
BUNDLE_MAX: int
KEY_MAX: int
__version__: str
libdlpc_version: str
CHANNEL_CAPACITY_DEFAULT: int
CHANNEL_CAPACITY_MAX: int

class EntryFlags(enum.IntFlag):
    # how an entry was published: publish(..., ephemeral=True) / publish(..., writable=True)
    EPHEMERAL = 2  # DLPC_PUBLISH_EPHEMERAL
    WRITABLE = 4  # DLPC_PUBLISH_WRITABLE

# (stub only) How attach() maps an entry's memory (None: "read"):
#   "read"    read-only flag exported; mapped copy-on-write, so a consumer that ignores the flag
#             (torch) writes into private pages instead of crashing
#   "private" writable, copy-on-write: writes stay in this process
#   "strict"  read-only flag and read-only shared mapping: a write is SIGSEGV
#   "write"   shared writable (the entry must be published writable); writable=True says the same
_AttachMode = Literal["read", "private", "strict", "write"]

class TensorInfo(NamedTuple):
    key: str
    dtype: str
    shape: Tuple[int, ...]

class Owner(NamedTuple):
    uid: int
    pid: int

class EntryInfo(NamedTuple):
    name: str
    generation: int
    device: str
    tensors: builtins.list[TensorInfo]
    nbytes: int
    refs: int
    owner: Owner
    created: float
    flags: EntryFlags
    cached_refs: int
    created_ns: int

class WatchEvent(NamedTuple):
    kind: str
    name: str
    generation: int
    previous_generation: int
    device: str
    dtype: Optional[str]
    shape: Optional[Tuple[int, ...]]
    ntensors: int
    nbytes: int
    refs: int
    owner: Owner
    created: float
    flags: EntryFlags
    reason: Optional[str]
    actor: Owner
    seq: int

class Watch:
    closed: bool
    def __init__(self, prefix: str = ..., socket: Optional[str] = ...) -> None: ...
    def __iter__(self) -> Iterator[WatchEvent]: ...
    def __next__(self) -> WatchEvent: ...
    def next_event(self, timeout: Optional[float] = ...) -> Optional[WatchEvent]: ...
    def fileno(self) -> int: ...
    def drain(self) -> builtins.list[WatchEvent]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Watch": ...
    def __exit__(self, *exc: Any) -> None: ...  # exceptions propagate

@final  # made by attach() and empty(), never by a subclass
class SharedTensor:
    name: Optional[str]
    key: str
    generation: int
    mode: Optional[_AttachMode]
    owner: Optional[Owner]
    shape: Tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    readonly: bool
    data_ptr: int
    released: bool
    __dlpack_c_exchange_api__: Any
    def __dlpack__(self, *, stream: Any = ..., max_version: Optional[Tuple[int, int]] = ...,
                   dl_device: Optional[Tuple[int, int]] = ..., copy: Optional[bool] = ...) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    # torch.from_dlpack(self); a bool tensor where torch has no DLPack bool: uint8 viewed as bool
    def torch(self) -> Any: ...
    def release(self) -> None: ...
    def __enter__(self) -> "SharedTensor": ...
    def __exit__(self, *exc: Any) -> None: ...  # exceptions propagate

class Client:
    # reconnect=True: after a call raised ConnectionResetError (dlpackd closed the connection),
    # the next call connects anew; otherwise every later call raises ConnectionResetError.
    # A failed call is never retried, except that a waiting attach connects again and goes on
    # waiting. The module-level functions behave as reconnect=True.
    def __init__(self, socket: Optional[str] = ..., *, reconnect: bool = ...) -> None: ...
    @property
    def reconnects(self) -> int: ...
    def publish(self, name: str, obj: Any, *, replace: bool = ..., ephemeral: bool = ...,
                writable: bool = ...) -> int: ...
    def publish_dict(self, name: str, mapping: Mapping[str, Any], *, replace: bool = ...,
                     ephemeral: bool = ..., writable: bool = ...) -> int: ...
    def attach(self, name: str, *, timeout: Optional[float] = ...,
               mode: Optional[_AttachMode] = ..., owner: Optional[int] = ...,
               writable: Optional[bool] = ..., populate: bool = ...,
               stream: Optional[int] = ...) -> SharedTensor: ...
    def attach_dict(self, name: str, *, timeout: Optional[float] = ...,
                    mode: Optional[_AttachMode] = ..., owner: Optional[int] = ...,
                    writable: Optional[bool] = ...,
                    populate: bool = ...,
                    stream: Optional[int] = ...) -> builtins.dict[str, SharedTensor]: ...
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any,
              device: str = ...) -> SharedTensor: ...
    def empty_dict(self, spec: Mapping[str, Tuple[Union[int, Sequence[int]], Any]],
                   device: str = ...) -> builtins.dict[str, SharedTensor]: ...
    def unpublish(self, name: str, *, generation: Optional[int] = ...,
                  created_ns: Optional[int] = ...) -> None: ...
    def list(self, prefix: str = ...) -> builtins.list[EntryInfo]: ...
    def stat(self) -> builtins.dict[str, int]: ...
    def channel(self, name: str, capacity: int = ..., *, direct: Optional[bool] = ...,
                producers: int = ...) -> Channel: ...
    def channels(self, prefix: str = ...) -> builtins.list[ChannelInfo]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: Any) -> None: ...  # exceptions propagate

def publish(name: str, obj: Any, *, replace: bool = ..., ephemeral: bool = ...,
            writable: bool = ...) -> int: ...
def publish_dict(name: str, mapping: Mapping[str, Any], *, replace: bool = ...,
                 ephemeral: bool = ..., writable: bool = ...) -> int: ...
# with published(name, obj): ... publishes, yields the generation, unpublishes on exit
def published(name: str, obj: Any, *, client: Optional[Client] = ..., ephemeral: bool = ...,
              replace: bool = ..., writable: bool = ...) -> ContextManager[int]: ...
def published_dict(name: str, mapping: Mapping[str, Any], *, client: Optional[Client] = ...,
                   ephemeral: bool = ..., replace: bool = ...,
                   writable: bool = ...) -> ContextManager[int]: ...
# timeout, everywhere: None waits as long as it takes, 0 not at all, seconds then TimeoutError
# populate=True: the mapping is faulted in before the call returns (reading it takes no faults)
def attach(name: str, *, timeout: Optional[float] = ..., mode: Optional[_AttachMode] = ...,
           owner: Optional[int] = ..., writable: Optional[bool] = ...,
           populate: bool = ..., stream: Optional[int] = ...) -> SharedTensor: ...
def attach_dict(name: str, *, timeout: Optional[float] = ..., mode: Optional[_AttachMode] = ...,
                owner: Optional[int] = ..., writable: Optional[bool] = ...,
                populate: bool = ...,
                stream: Optional[int] = ...) -> builtins.dict[str, SharedTensor]: ...
def empty(shape: Union[int, Sequence[int]], dtype: Any, device: str = ...) -> SharedTensor: ...
def empty_dict(spec: Mapping[str, Tuple[Union[int, Sequence[int]], Any]],
               device: str = ...) -> builtins.dict[str, SharedTensor]: ...
def cuda_releases_held() -> ContextManager[None]: ...
def unpublish(name: str, *, generation: Optional[int] = ...,
              created_ns: Optional[int] = ...) -> None: ...
def list(prefix: str = ...) -> builtins.list[EntryInfo]: ...
def stat() -> builtins.dict[str, int]: ...
def watch(prefix: str = ..., *, socket: Optional[str] = ...) -> Watch: ...

class ChannelInfo(NamedTuple):
    name: str
    capacity: int
    depth: int
    bytes_queued: int
    sent: int
    received: int
    receivers_waiting: int
    senders_waiting: int
    owner: Owner
    created: float
    direct: bool
    ended: bool
    producers: int
    producers_closed: int
    producers_expected: int
    fallback: Optional[str]

class ChannelClosed(EOFError): ...

_RecvMode = Literal["read", "private", "strict"]

class Channel:
    name: str
    capacity: int
    # the kind: direct=None makes a new channel direct where it can serve (docs/channels.md,
    # "Which kind"); fallback: why it made one queued instead, or None
    direct: bool
    fallback: Optional[str]
    def __init__(self, name: str, capacity: int = ..., *, direct: Optional[bool] = ...,
                 producers: int = ..., client: Optional[Client] = ...) -> None: ...
    def __enter__(self) -> Channel: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def close(self, all: bool = ...) -> None: ...
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any) -> SharedTensor: ...
    def send(self, obj: Any, *, timeout: Optional[float] = ...) -> None: ...
    def send_dict(self, mapping: Mapping[str, Any], *, timeout: Optional[float] = ...) -> None: ...
    # a SharedTensor for a one-tensor message, a dict of them by key for a bundle
    def recv(self, *, timeout: Optional[float] = ..., mode: Optional[_RecvMode] = ...
             ) -> Union[SharedTensor, builtins.dict[str, SharedTensor]]: ...
    def recv_dict(self, *, timeout: Optional[float] = ..., mode: Optional[_RecvMode] = ...
                  ) -> builtins.dict[str, SharedTensor]: ...
    def __iter__(self) -> Iterator[Union[SharedTensor, builtins.dict[str, SharedTensor]]]: ...
    def stat(self) -> ChannelInfo: ...
    def remove(self) -> None: ...

def channel(name: str, capacity: int = ..., *, direct: Optional[bool] = ...,
            producers: int = ..., client: Optional[Client] = ...) -> Channel: ...
def channels(prefix: str = ...) -> builtins.list[ChannelInfo]: ...
