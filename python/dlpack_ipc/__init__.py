# SPDX-License-Identifier: Apache-2.0
"""Share tensors between processes on one machine through dlpackd, zero-copy.

    import numpy as np, dlpack_ipc
    with dlpack_ipc.published("weights", np.arange(6.0)):  # one process publishes ...
        ...
    t = dlpack_ipc.attach("weights")                        # another waits for it and maps it
    a = np.from_dlpack(t)                                   # the same memory, read-only

The calls most people need:
    published(name, obj)   publish for the duration of a with block, then unpublish
    publish(name, obj)     publish until unpublish(); publish_dict() for a state dict
    attach(name)           the tensor published under name; attach_dict() for a state dict
    channel(name)          a named queue of tensors: send(), recv(), close(), for msg in ch
    dlpack_ipc.torch       share_module() / attach_module(): a model's weights, zero-copy

The rest: empty() and empty_dict() (memory published without a copy), unpublish(), list(),
stat(), watch() (changes as they happen), Client (a connection of one's own). help() of each
says what it does; docs/python.md is the manual.

Waiting: timeout=None waits as long as it takes (Ctrl-C interrupts), 0 not at all, a number
of seconds then TimeoutError.

The module-level functions share one Client, connected on first use to the default socket:
$DLPACKD_SOCKET if set, else $XDG_RUNTIME_DIR/dlpackd.sock (a daemon of your own) if it
exists, else /run/dlpackd/dlpackd.sock (the service's, for the group dlpack). If dlpackd
restarts, the call that finds the connection closed raises ConnectionResetError and the next
call connects anew (see Client). A Client used in a forked child reconnects by itself.

From a shell: python -m dlpack_ipc ls | rm | stat | watch | channels (see its --help).
"""
import contextlib
import enum
import errno
import os
import sys
import threading
from collections import namedtuple

from . import _core
from ._core import (
    BUNDLE_MAX,
    KEY_MAX,
    NAME_MAX,
    NDIM_MAX,
    SharedTensor,
    __version__,
    libdlpc_version,
)
from ._core import Client as _CoreClient
from ._core import Watch as _CoreWatch

__all__ = [
    "Client", "SharedTensor", "EntryInfo", "EntryFlags", "TensorInfo", "Owner", "publish",
    "publish_dict", "published", "published_dict", "attach", "attach_dict", "empty",
    "empty_dict", "unpublish", "list", "stat", "cuda_releases_held",
    "watch", "Watch", "WatchEvent", "channel", "channels", "Channel", "ChannelInfo",
    "ChannelClosed",
    "CHANNEL_CAPACITY_DEFAULT", "CHANNEL_CAPACITY_MAX",
]


class EntryFlags(enum.IntFlag):
    """How an entry was published: EntryInfo.flags and WatchEvent.flags.

    EPHEMERAL  publish(..., ephemeral=True): it goes when its publisher's connection closes
    WRITABLE   publish(..., writable=True): attachers may map it shared and writable
    Test with `EntryFlags.WRITABLE in e.flags`; the values are libdlpc's DLPC_PUBLISH_* bits.
    """
    EPHEMERAL = _core.PUBLISH_EPHEMERAL
    WRITABLE = _core.PUBLISH_WRITABLE


TensorInfo = namedtuple("TensorInfo", "key dtype shape")
TensorInfo.__doc__ = "One tensor of a listed entry."
Owner = namedtuple("Owner", "uid pid")
Owner.__doc__ = "Who published an entry, from the daemon's SO_PEERCRED."
EntryInfo = namedtuple("EntryInfo",
                       "name generation device tensors nbytes refs owner created flags "
                       "cached_refs created_ns")
EntryInfo.__doc__ = """A published entry: tensors is a list of TensorInfo (empty when the
entry is too large to describe in one reply), refs counts live attach references (cached_refs of
them idle in a client's cache of re-attaches), created is in seconds since the epoch (created_ns
the same in ns, exact: with generation it names this entry for unpublish()), flags is an
EntryFlags."""

WatchEvent = namedtuple("WatchEvent",
                        "kind name generation previous_generation device dtype shape ntensors "
                        "nbytes refs owner created flags reason actor seq")
WatchEvent.__doc__ = """One change of the daemon's names, as watch() reports it.

kind: "published", "replaced" or "unpublished" (or "channel_opened", "channel_removed": then
only name, actor and seq mean something). The other fields describe the entry published or
removed: dtype and shape of its tensor (None for a bundle of ntensors); previous_generation
is what a "replaced" took over; reason ("request" or "disconnect") why it was unpublished;
actor the Owner that made the change; seq numbers the daemon's changes 1, 2, 3..."""

_list = list  # the builtin, before this module's list() shadows it

CHANNEL_CAPACITY_DEFAULT = 16  # DLPC_CHANNEL_CAPACITY_DEFAULT
CHANNEL_CAPACITY_MAX = 65536  # DLPC_CHANNEL_CAPACITY_MAX

ChannelInfo = namedtuple("ChannelInfo",
                         "name capacity depth bytes_queued sent received receivers_waiting "
                         "senders_waiting owner created direct ended producers "
                         "producers_closed producers_expected fallback")
ChannelInfo.__doc__ = """A channel: depth messages queued (bytes_queued bytes) of capacity, sent
and received since it was opened, receivers and senders waiting now, the Owner that opened it,
created in seconds since the epoch, whether it is direct (its messages go between the
processes; dlpackd counts only depth, the rest reads 0), whether its stream has ended, its
producers that have not closed and that have, producers_expected: the closes its end waits
for at least (as opened), and fallback: why it is queued although it was opened as channel()'s
default asks (direct where that kind can serve), as Channel.fallback says it; None otherwise."""


def _channel_info(d):
    return ChannelInfo(d["name"], d["capacity"], d["depth"], d["bytes_queued"], d["sent"],
                       d["received"], d["receivers_waiting"], d["senders_waiting"],
                       Owner(d["uid"], d["pid"]), d["created"], d["direct"], d["ended"],
                       d["producers"], d["producers_closed"], d["producers_expected"],
                       d["fallback"])


class ChannelClosed(EOFError):
    """The channel's stream has ended: every producer closed it (or it was closed for all),
    and every message sent before that was received. Raised by Channel.recv(); iterating a
    Channel stops on it."""


def _publishable(obj):
    """What publish() takes in place of obj, whose own DLPack export failed (called from C).

    Returns (stand-in, dtype) where dtype names the dtype the stand-in's bytes are published as
    (None: its own), or None to let the producer's error stand. Objects with the buffer protocol
    (numpy 1.x's read-only arrays) never get here: publish() reads their buffer.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()  # a parameter, or any tensor that requires grad: its data
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.dtype == torch.bool:
            # torch 1.x has no DLPack bool: the same bytes as uint8, published as kDLBool
            return t.view(torch.uint8), "bool"
        if obj.requires_grad or obj.is_conj() or obj.is_neg():
            return t, None
        return None
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if not obj.dtype.isnative:
            return obj.astype(obj.dtype.newbyteorder("=")), None
        return None
    if np is not None and (hasattr(obj, "__array_interface__")
                           or hasattr(obj, "__array_struct__")):
        return np.asarray(obj), None
    return None


class _Closing:
    """A with block closes it (close())."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class Client(_Closing, _CoreClient):
    """A connection to dlpackd of one's own, with the module's calls as methods; a context
    manager: Client(socket=None, *, reconnect=False).

    socket: the daemon's socket path (None: the default socket, see the module's doc).
    When dlpackd closes the connection (it stopped or restarted), the call that finds it
    closed raises ConnectionResetError and is not retried. Then with reconnect=False every
    later call raises it too; with reconnect=True (as the module-level functions) the next
    call connects anew, and an attach waiting for a name reconnects and goes on waiting.
    Tensors attached before stay valid. docs/python.md has the details.
    """

    def __init__(self, socket=None, *, reconnect=False):
        super().__init__(socket, reconnect=reconnect)

    def list(self, prefix=""):
        """Entries whose names start with prefix, sorted by name, as EntryInfo tuples."""
        return [EntryInfo(e["name"], e["generation"], e["device"],
                          [TensorInfo(*t) for t in e["tensors"]], e["nbytes"], e["refs"],
                          Owner(e["uid"], e["pid"]), e["created"], EntryFlags(e["flags"]),
                          e["cached_refs"], e["created_ns"])
                for e in self._list(prefix)]

    def channel(self, name, capacity=0, *, direct=None, producers=0):
        """Open the channel name on this connection (see Channel)."""
        return Channel(name, capacity, direct=direct, producers=producers, client=self)

    def channels(self, prefix=""):
        """Channels whose names start with prefix, sorted by name, as ChannelInfo tuples."""
        return [_channel_info(d) for d in self._channel_list(prefix)]


class Channel:
    """A named FIFO of tensors: Channel(name, capacity=0, *, direct=None, producers=0,
    client=None). Producers send(), consumers recv() or iterate; a producer's close() (or the
    end of its with block) says it sends no more, and once every producer has closed, the
    consumers get what is still queued and then the end: recv() raises ChannelClosed and
    `for msg in ch` stops.

    Opening creates the channel unless it exists, with room for capacity messages (0:
    CHANNEL_CAPACITY_DEFAULT, 16; at most CHANNEL_CAPACITY_MAX); a channel opened already with
    another non-zero capacity raises FileExistsError. It lives until remove(), not with this
    object. client: the Client to use (None: the module's default one); a Channel used in a
    forked child (a DataLoader worker) reconnects by itself, as a Client does.

    send(obj) copies obj into sealed shared memory (no copy for empty() memory) and queues it;
    recv() hands the oldest message to exactly one receiver, in order, mapped as attach() maps
    (mode "read", "private" or "strict"). A receiver already waiting gets the message in the
    daemon turn that queues it. A full channel makes send() wait (timeout=None: as long as it
    takes; 0: BlockingIOError at once; seconds: then TimeoutError); an empty one makes recv()
    wait the same way.

    End of stream: a process (its connection to dlpackd) becomes a producer with its first
    send(). close() ends its part; a producer whose process exits or dies without close() has
    closed too, so consumers never wait on the dead. The stream ends once every producer has
    closed, and at least `producers` of them (given when the channel is created; 0 means 1):
    when producers start at different times, pass producers=N, or the first to finish may end
    the stream before the others begin. close() on a Channel that only received does nothing,
    so a consumer may use `with` too; close() on one that neither sent nor received counts as
    a producer with nothing to send where this process runs as the channel's owner uid or root
    (of another uid, it does nothing: another uid takes part by sending). close(all=True) ends
    the stream at once for every producer (the channel's owner uid, or root). After the end,
    send() raises BrokenPipeError; the channel stays ended until remove(), and is then opened
    anew for a new stream. A Channel inherited across fork() starts with nothing of the
    parent's: what the child sent or received decides what its close() does.

    remove() is not an end: it frees every message still queued (they are lost) and makes sends
    and receives waiting on it raise OSError(errno.EIDRM); iteration stops then too.

    Delivery is at most once: a message is freed when its receiver drops every tensor of it, or
    when the receiver's process dies holding it, and is never given to another receiver;
    interrupting a recv() (Ctrl-C) may drop the message it was about to get, and an interrupted
    send() may still be delivered once room comes (while this connection stays open). Messages
    a sender sent stay queued after it exits.

    Kinds (the rule: docs/channels.md, "Which kind"): a direct channel's messages go from
    sender to receiver through a socket pair dlpackd hands to each process, queued by the
    kernel, never through the daemon (a hand-off costs about what passing an fd over a Unix
    socket does); a queued one's go through dlpackd. The same delivery and end of stream; but
    a direct channel's capacity is what the kernel's buffer limit allows (self.capacity says),
    stat() counts only the messages queued, each message describes at most about 1000 bytes of
    tensors (a few dozen of a bundle: OSError EMSGSIZE beyond), there are no recycled buffers
    (empty() raises BufferError), a receiver checks every message itself and drops one that
    fails (OSError EBADMSG, naming its sender). direct=None (the default) opens an existing
    channel as the kind it is and creates a direct one where that kind can serve, a queued one
    where it cannot (a capacity beyond what the kernel lets a direct channel queue, or no fds
    for its sockets); self.fallback then says why (None otherwise). direct=False asks for the
    queued kind (for empty() or large bundles), direct=True for the direct one; either raises
    FileExistsError, naming the kind, for a channel of the other. self.direct says which.

    A receiver keeps the mapping of a storage that comes again (a buffer the sender sends again
    and again: empty() memory, or one array sent repeatedly): its next message is handed that
    mapping instead of a new one, emptied first of what a consumer wrote into it in the default
    mode. It keeps the storage's memory alive up to DLPC_CACHE_IDLE_MS (1 s) after the sender
    let go of it; the DLPC_CACHE_* variables bound it, DLPC_CACHE_ENTRIES=0 turns it off
    (see dlpc(3)).
    """

    def __init__(self, name, capacity=0, *, direct=None, producers=0, client=None):
        self._client = client if client is not None else _client()
        self.name = name
        # what this process did with it (a forked child starts with nothing of its parent's:
        # its connection is its own, and so is its role)
        self._pid = os.getpid()
        self._sent = False
        self._received = False
        info = self._client._channel_open(name, capacity, direct, producers)
        self.capacity = info["capacity"]
        self.direct = info["direct"]
        self.fallback = info["fallback"]

    def __repr__(self):
        return (f"dlpack_ipc.Channel({self.name!r}, capacity={self.capacity}"
                f", direct={self.direct})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except FileNotFoundError:
            pass  # removed meanwhile: nothing is left to end
        except (OSError, ValueError):
            # the block's exception is the one to see: a client closed or a daemon gone
            # meanwhile (whose connection's end closed this producer already) does not replace it
            if exc[0] is None:
                raise
        return False

    def _ours(self):
        """Forget what the process that forked this one sent or received on it."""
        if self._pid != os.getpid():
            self._pid, self._sent, self._received = os.getpid(), False, False

    def send(self, obj, *, timeout=None):
        """Send obj (anything publish() takes) as one message; BrokenPipeError after the end."""
        self._ours()
        self._sent = True
        self._client._send(self.name, obj, timeout=timeout)

    def send_dict(self, mapping, *, timeout=None):
        """Send a mapping of str keys to tensors as one message (a bundle); keys as for
        publish_dict(), refused with the same errors."""
        self._ours()
        self._sent = True
        self._client._send_dict(self.name, mapping, timeout=timeout)

    def empty(self, shape, dtype):
        """Recycled writable memory for a message: fill it, send() it, then drop it.

        It comes from this connection's pool: once a receiver has released a message sent from
        it, dlpackd gives the buffer back and a later empty() of a size that fits (up to twice
        the need) hands out the same pages again, so a steady pipeline needs no fresh memory.
        A pooled message is NOT read-only for its sender: the buffer stays writable here, and a
        write after send() would change what a receiver reads (the trade torch.multiprocessing
        makes too). Receivers cannot write it (they get a read-only descriptor).
        Send it on this Channel's client; OSError(ENOBUFS) when all of the pool's buffers
        (DLPC_POOL_BUFFERS_MAX, 64) are in flight or still held."""
        return self._client._channel_empty(self.name, shape, dtype)

    def recv(self, *, timeout=None, mode=None):
        """The oldest message: a SharedTensor, or a dict of them by key for a bundle.
        ChannelClosed once the stream has ended and nothing is left."""
        self._ours()
        self._received = True
        try:
            return self._client._recv(self.name, timeout=timeout, mode=mode)
        except EOFError as e:
            raise ChannelClosed(*e.args) from None

    def recv_dict(self, *, timeout=None, mode=None):
        """The oldest message as a dict by key (a single tensor under the key ""); as recv()."""
        self._ours()
        self._received = True
        try:
            return self._client._recv(self.name, timeout=timeout, mode=mode, bundle=True)
        except EOFError as e:
            raise ChannelClosed(*e.args) from None

    def __iter__(self):
        """Every message, until the end of the stream (or the channel's removal)."""
        while True:
            try:
                yield self.recv()
            except ChannelClosed:
                return
            except OSError as e:
                if e.errno in (errno.EIDRM, errno.ENOENT):
                    return
                raise

    def close(self, all=False):
        """This producer sends no more (see Channel: the stream ends once every producer
        closed). Nothing on a Channel that only received. all=True: end the stream now for
        every producer (its owner uid or root). Closing again is harmless. In a forked child
        only what the child itself did counts."""
        self._ours()
        if not all and self._received and not self._sent:
            return
        self._client._channel_close(self.name, all)

    def stat(self):
        """This channel as a ChannelInfo."""
        return _channel_info(self._client._channel_stat(self.name))

    def remove(self):
        """Remove the channel (its opener's uid, or root): every message still queued is
        dropped, unread; waiting sends and receives raise OSError(errno.EIDRM). To end a
        stream and keep what is queued for the consumers, close() instead."""
        self._client._channel_remove(self.name)


def channel(name, capacity=0, *, direct=None, producers=0, client=None):
    """Open (create unless it exists) the channel name: a Channel (direct, producers: see
    Channel; a new one is direct where that kind can serve, docs/channels.md "Which kind").
    Use it in a with block: leaving it closes this producer's side."""
    return Channel(name, capacity, direct=direct, producers=producers, client=client)


def channels(prefix=""):
    """Channels whose names start with prefix, sorted by name, as ChannelInfo tuples."""
    return _client().channels(prefix)


def _event(d):
    return WatchEvent(d["kind"], d["name"], d["generation"], d["previous_generation"],
                      d["device"], d["dtype"], d["shape"], d["ntensors"], d["nbytes"], d["refs"],
                      Owner(d["uid"], d["pid"]), d["created"], EntryFlags(d["flags"]), d["reason"],
                      Owner(d["actor_uid"], d["actor_pid"]), d["seq"])


class Watch(_Closing, _CoreWatch):
    """The changes of the names that start with prefix, as they happen: Watch(prefix="",
    socket=None). Iterating yields a WatchEvent per change, in the daemon's order.

    Iterating waits as long as it takes (Ctrl-C interrupts); next_event(timeout) returns None
    if nothing came in time. A connection of its own: close() or a with block ends it. If the
    daemon drops the watch (it stopped, or this watcher fell behind) the next read raises
    ConnectionResetError. For select()/poll() on fileno(): when readable, take drain().
    """

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        try:
            return _event(self._next(None))
        except ValueError:
            if self.closed:  # closed by another thread while waiting
                raise StopIteration from None
            raise

    def next_event(self, timeout=None):
        """The next WatchEvent, or None if none came within timeout seconds (None: forever)."""
        d = self._next(timeout)
        return None if d is None else _event(d)

    def drain(self):
        """Every event that can be had without waiting, as a list (for select()/poll() users)."""
        out = []
        while (ev := self.next_event(0)) is not None:
            out.append(ev)
        return out


def watch(prefix="", *, socket=None):
    """The changes of the names that start with prefix, as they happen: a Watch, an iterator
    of WatchEvent."""
    return Watch(prefix, socket=socket)


_default = None
_default_lock = threading.Lock()


def _client():
    global _default
    c = _default
    if c is None:
        with _default_lock:
            if _default is None:
                _default = Client(reconnect=True)
            c = _default
    return c


def _reset_default():
    """Forget the default client (the next call connects again); for tests and reconfiguring."""
    global _default
    with _default_lock:
        old, _default = _default, None
    if old is not None:
        old.close()


def publish(name, obj, *, replace=False, ephemeral=False, writable=False):
    """Publish obj under name until unpublish(); returns the generation (1, then one more per
    replace). published() unpublishes at the end of a with block instead.

    obj: a tensor or array (numpy, torch, CuPy, JAX: anything with __dlpack__), a DLPack
    capsule, a buffer, or a SharedTensor; host data is copied into sealed shared memory,
    memory from empty() is published as it is. A dict is publish_dict()'s.
    replace: take over the name if it is published (by this uid, or as root); without it a
    taken name raises FileExistsError. Attachers of the old generation keep its bytes.
    ephemeral: the entry goes when this process's connection closes.
    writable: attachers may map it shared and writable (attach(mode="write")); otherwise the
    memory is sealed read-only for every process, this one included.
    """
    try:
        return _client().publish(name, obj, replace=replace, ephemeral=ephemeral,
                                 writable=writable)
    except BaseException:
        # the traceback keeps this frame: not obj with it, so that a refused tensor's memory
        # is its producer's again at once (the caller may need it for a fallback copy)
        del obj
        raise


def publish_dict(name, mapping, *, replace=False, ephemeral=False, writable=False):
    """Publish a mapping of str keys to tensors (a state dict) as one entry; returns the
    generation. Values as for publish(), keys at most KEY_MAX bytes of UTF-8; errors name the
    key. replace, ephemeral and writable as for publish()."""
    try:
        return _client().publish_dict(name, mapping, replace=replace, ephemeral=ephemeral,
                                      writable=writable)
    except BaseException:
        del mapping  # as in publish(): the traceback keeps this frame, not the tensors
        raise


def _unpublish_if(c, name, mine):
    """Unpublish name if it still holds the publish mine identifies (a generation that
    replaced ours, or the name published anew, is not ours to remove). mine: (generation,
    created_ns) from the publish's reply, which the daemon checks and acts on in one step."""
    if not mine:
        return
    try:
        c.unpublish(name, generation=mine[0], created_ns=mine[1])
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.ESTALE:  # replaced or published anew meanwhile: not ours
            raise


def _held(c, name, generation):
    """The body of published(): yield generation, then unpublish it if it is still ours."""
    # what this publish made, as the daemon answered it (this thread's last publish on c)
    mine = c._last_published()
    if mine and mine[0] != generation:
        mine = None
    try:
        yield generation
    except BaseException:
        # the block's exception is the one to see: a client closed or a daemon gone meanwhile
        # (whose ephemeral entry went with the connection) does not replace it
        try:
            _unpublish_if(c, name, mine)
        except (OSError, ValueError):
            pass
        raise
    _unpublish_if(c, name, mine)


@contextlib.contextmanager
def published(name, obj, *, client=None, ephemeral=True, **publish_kwargs):
    """Publish obj under name for the duration of a with block; yields the generation.

        with dlpack_ipc.published("weights", t):
            ...  # other processes attach "weights" here

    On exit, even by an exception, name is unpublished, unless it is gone already or another
    publish took it over meanwhile (that one is left alone: the daemon removes the entry only
    if it still is this publish's, in one step, so a replace that lands at any moment
    survives). ephemeral (True here) also removes it if this process dies inside the block.
    Other keywords are publish()'s; client: the Client to use (None: the module's default
    one).
    """
    c = client if client is not None else _client()
    try:
        gen = c.publish(name, obj, ephemeral=ephemeral, **publish_kwargs)
    except BaseException:
        del obj  # as in publish()
        raise
    yield from _held(c, name, gen)


@contextlib.contextmanager
def published_dict(name, mapping, *, client=None, ephemeral=True, **publish_kwargs):
    """publish_dict() for the duration of a with block; yields the generation (see
    published())."""
    c = client if client is not None else _client()
    try:
        gen = c.publish_dict(name, mapping, ephemeral=ephemeral, **publish_kwargs)
    except BaseException:
        del mapping  # as in publish()
        raise
    yield from _held(c, name, gen)


def attach(name, *, timeout=None, mode=None, owner=None, writable=None, populate=False,
           stream=None):
    """The tensor published under name, as a SharedTensor over the same memory (hand it to
    np.from_dlpack or torch.from_dlpack). A state dict is attach_dict()'s.

    timeout: how long to wait for name to be published: None (or float("inf")) as long as it
    takes (Ctrl-C interrupts), 0 not at all (FileNotFoundError), seconds then TimeoutError.
    mode: how this process maps the memory:
      "read"     (default) read-only for numpy; a write by torch, which ignores the flag, goes
                 to pages of this process's own (copy-on-write)
      "private"  writable, copy-on-write: writes stay in this process
      "strict"   mapped read-only: any write is SIGSEGV
      "write"    shared and writable, for an entry published writable=True
    writable=True is the older spelling of mode="write".
    owner: a uid: an entry under name published by another uid counts as absent.
    populate: map every page of the memory before returning (MADV_POPULATE_READ, Linux 5.14),
    for a consumer that will read all of it (model weights): the attach takes longer, and
    reading then takes no page faults (without it, one per 64 KiB or so on first touch). In
    every mode; "read" and "private" stay copy-on-write. Before Linux 5.14 it does nothing.
    stream: CUDA entries: the stream this process works on (an int: a cudaStream_t such as
    torch.cuda.current_stream().cuda_stream, 1 the legacy default stream, 2 the per-thread
    one), ordered after the publisher at once and followed by the release (docs/gpu.md,
    "Which stream orders what"); None: named later, by __dlpack__(stream=...).
    """
    return _client().attach(name, timeout=timeout, mode=mode, owner=owner, writable=writable,
                            populate=populate, stream=stream)


def attach_dict(name, *, timeout=None, mode=None, owner=None, writable=None, populate=False,
                stream=None):
    """Attach every tensor of a bundle, in one round trip and one mapping, as a dict of
    SharedTensor by key. timeout, mode, writable, owner, populate and stream as for attach()."""
    return _client().attach_dict(name, timeout=timeout, mode=mode, owner=owner,
                                 writable=writable, populate=populate, stream=stream)


def empty(shape, dtype, device="cpu"):
    """Writable shared memory to fill in place; publish() then shares it without a copy.

    device: "cpu", or "cuda" / "cuda:N" for CUDA memory on that device (synchronize before
    publishing: attachers get no event to wait on)."""
    return _client().empty(shape, dtype, device)


def empty_dict(spec, device="cpu"):
    """A state dict to fill in place: {key: (shape, dtype)} -> {key: SharedTensor} in one
    allocation; publish_dict() of the whole dict, in its order, shares it without a copy.
    device as for empty()."""
    return _client().empty_dict(spec, device)


@contextlib.contextmanager
def cuda_releases_held():
    """Hold back, in this whole process, the releases of attached CUDA tensors for the
    duration of a with block: wrap a CUDA graph capture in it when another thread (the garbage
    collector) may drop attached tensors meanwhile.

        with dlpack_ipc.cuda_releases_held():
            with torch.cuda.graph(g):
                ...

    A tensor whose consumer named a non-blocking stream (torch.from_dlpack under a side
    stream) is released after all of its device's work, and that synchronization would
    invalidate a capture under way on a non-blocking stream, which libdlpc cannot see; and
    the event a release records on the legacy stream would invalidate a capture on a blocking
    stream that began just before. Meanwhile nothing is released (the memory stays mapped),
    and the releases go when the last hold ends. Holds nest and may be taken on any thread.
    See docs/gpu.md, "Which stream orders what"."""
    _core._cuda_hold_releases()
    try:
        yield
    finally:
        _core._cuda_resume_releases()


def unpublish(name, *, generation=None, created_ns=None):
    """Remove the entry name (its publisher's uid, or root, may); attached tensors stay valid
    until released.

    generation, created_ns (an EntryInfo's): remove it only if it still is that entry, checked
    and removed in one step by the daemon; otherwise OSError with errno ESTALE, and nothing
    changes. A generation starts again at 1 once a name is freed, so pass created_ns too to
    tell the entry meant from one published anew.
    """
    return _client().unpublish(name, generation=generation, created_ns=created_ns)


def list(prefix=""):  # noqa: A001 - the documented name
    """Published entries whose names start with prefix, as EntryInfo tuples."""
    return _client().list(prefix)


def stat():
    """The daemon's counters, as a dict of ints (the fields of dlpc_stats in dlpc.h):

    daemon_pid, uptime_ms; connections, entries, storages (named or still referenced),
    bytes_held (their sizes), references (live attaches), waiters (waiting attaches),
    watchers, events (changes of the name map since start); fds_open, fds_sent, fds_closing;
    tx_queued (bytes in output queues), queue_drops, protocol_errors; req_hello, req_publish,
    req_attach, req_release, req_unpublish, req_list, req_stat, req_watch (requests served);
    and for the caller's uid: uid_bytes_held (bytes of storages it published that a name
    still reaches), uid_bytes_pinned (bytes of unnamed storages its references keep alive;
    both count against its quota), uid_entries, uid_connections; channels: channels,
    messages (queued, and sends waiting for room), req_send, req_recv, req_channel, req_cancel,
    uid_channels; cached_references (of references, those idle in a client's cache of
    re-attaches, see dlpc(3)) and invalidations (cache invalidations sent since start);
    fd_budget (fds storages and connections may use together) and fds_own
    (the daemon's own fds at start, kept out of that budget)."""
    return _client().stat()
