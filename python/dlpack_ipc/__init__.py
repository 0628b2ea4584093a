# SPDX-License-Identifier: Apache-2.0
"""Share tensors between processes on one machine through dlpackd, zero-copy.

    import numpy as np, torch, dlpack_ipc
    dlpack_ipc.publish("weights", np.arange(6.0))          # in one process
    t = dlpack_ipc.attach("weights", timeout=5)            # in another
    a = np.from_dlpack(t)                                  # the same memory, read-only
    w = torch.from_dlpack(t).add_(1)                       # a private copy-on-write change

Module-level functions use one default Client, created on first use, connected to the default
socket ($DLPACKD_SOCKET, else /run/dlpackd/dlpackd.sock for root, else
$XDG_RUNTIME_DIR/dlpackd.sock). A Client used in a forked child reconnects by itself.

When dlpackd stops or restarts, the call that finds the connection closed raises
ConnectionResetError (whether it was sent before or during the restart, or the client sat idle).
The module-level functions then connect anew on the next call, as does a Client(reconnect=True);
a plain Client keeps raising ConnectionResetError. A failed call is never retried for you: a
publish may or may not have happened. See Client for the rest of the rules.
"""
import contextlib
import enum
import errno
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
    "publish_dict", "published", "published_dict", "attach", "attach_dict", "empty", "empty_dict", "unpublish", "list", "stat",
    "watch", "Watch", "WatchEvent", "channel", "channels", "Channel", "ChannelInfo",
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
                       "cached_refs")
EntryInfo.__doc__ = """A published entry: tensors is a list of TensorInfo (empty when the
entry is too large to describe in one reply), refs counts live attach references (cached_refs of
them idle in a client's cache of re-attaches), created is in seconds since the epoch, flags is an
EntryFlags."""

WatchEvent = namedtuple("WatchEvent",
                        "kind name generation previous_generation device dtype shape ntensors "
                        "nbytes refs owner created flags reason actor seq")
WatchEvent.__doc__ = """One change of the daemon's names, as watch() reports it.

kind is "published", "replaced" or "unpublished"; or "channel_opened" or "channel_removed"
for a channel under the prefix (then name is the channel's and the entry fields are zero or
None). The other fields describe the entry that was
published, or the one removed: dtype and shape are those of its tensor, or None for a bundle
(ntensors says how many it holds). previous_generation is the generation a "replaced" took over
(else 0); reason is "request" or "disconnect" (an ephemeral publisher went away) for
"unpublished", else None; actor is the Owner (uid, pid) of the connection that made the change;
seq numbers the daemon's changes, 1, 2, 3...; flags is an EntryFlags."""

_list = list  # the builtin, before this module's list() shadows it

CHANNEL_CAPACITY_DEFAULT = 16  # DLPC_CHANNEL_CAPACITY_DEFAULT
CHANNEL_CAPACITY_MAX = 65536  # DLPC_CHANNEL_CAPACITY_MAX

ChannelInfo = namedtuple("ChannelInfo",
                         "name capacity depth bytes_queued sent received receivers_waiting "
                         "senders_waiting owner created direct")
ChannelInfo.__doc__ = """A channel: depth messages queued (bytes_queued bytes) of capacity, sent
and received since it was opened, receivers and senders waiting now, the Owner that opened it,
created in seconds since the epoch, and whether it is direct (its messages go between the
processes; dlpackd counts only depth, the rest reads 0)."""


def _channel_info(d):
    return ChannelInfo(d["name"], d["capacity"], d["depth"], d["bytes_queued"], d["sent"],
                       d["received"], d["receivers_waiting"], d["senders_waiting"],
                       Owner(d["uid"], d["pid"]), d["created"], d["direct"])


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


class Client(_CoreClient):
    """A connection to dlpackd: Client(socket=None, *, reconnect=False). A context manager.

    socket: the daemon's socket path (None: the default socket, see the module's doc).

    When dlpackd closes the connection (it stopped, crashed or restarted), every call that finds
    it closed raises ConnectionResetError: a call in flight, and the next call of an idle
    client, alike. Such a call is not retried: whether a publish or unpublish took effect is
    unknown (list() tells). Then:
      reconnect=False  every later call raises ConnectionResetError: make a new Client.
      reconnect=True   the next call connects anew (the module-level functions work so); if no
                       dlpackd listens yet it raises ConnectionRefusedError or
                       FileNotFoundError, and the call after tries again. An attach waiting
                       for a name (timeout not 0) is the exception: it connects again by
                       itself and goes on waiting, so it completes when the name is published
                       on the restarted daemon; it raises at once an error of connecting
                       again that waiting does not mend (permissions, a daemon of another
                       protocol version). `reconnects` counts the new connections.
    Tensors attached before the break stay valid: their mappings are this process's; their
    releases are dropped with the old connection. Entries are the daemon's: those that are not
    ephemeral survive a restart with systemd's fd store and an upgrade in place (dlpackd(8));
    ephemeral ones end with the connection that published them. While another thread's call
    still runs on the lost connection, calls fail as it did; the next one connects anew.
    """

    def __init__(self, socket=None, *, reconnect=False):
        super().__init__(socket, reconnect=reconnect)

    def list(self, prefix=""):
        """Entries whose names start with prefix, sorted by name, as EntryInfo tuples."""
        return [EntryInfo(e["name"], e["generation"], e["device"],
                          [TensorInfo(*t) for t in e["tensors"]], e["nbytes"], e["refs"],
                          Owner(e["uid"], e["pid"]), e["created"], EntryFlags(e["flags"]),
                          e["cached_refs"])
                for e in self._list(prefix)]

    def channel(self, name, capacity=0, *, direct=False):
        """Open the channel name on this connection (see Channel)."""
        return Channel(name, capacity, direct=direct, client=self)

    def channels(self, prefix=""):
        """Channels whose names start with prefix, sorted by name, as ChannelInfo tuples."""
        return [_channel_info(d) for d in self._channel_list(prefix)]


class Channel:
    """A named FIFO of tensors: Channel(name, capacity=0, *, direct=False, client=None).

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
    wait the same way. Iterating receives until the channel is removed.

    Delivery is at most once: a message is freed when its receiver drops every tensor of it, or
    when the receiver's process dies holding it, and is never given to another receiver;
    interrupting a recv() (Ctrl-C) may drop the message it was about to get, and an interrupted
    send() may still be delivered once room comes (while this connection stays open). Messages
    a sender sent stay queued after it exits. remove() frees the queue; sends and receives waiting on it
    raise OSError(errno.EIDRM).

    direct=True opens (creates) a direct channel: its messages go from sender to receiver through
    a socket pair dlpackd hands to each process, queued by the kernel, never through the daemon
    (a hand-off costs about what passing an fd over a Unix socket does). The same delivery; but
    its capacity is what the kernel's buffer limit allows (self.capacity says), stat() counts
    only the messages queued, each message describes at most about 1000 bytes of tensors (a few
    dozen of a bundle), there are no recycled buffers (empty() raises), a receiver checks every
    message itself and drops one that fails (OSError EBADMSG, naming its sender). self.direct
    says which kind it is.

    A receiver keeps the mapping of a storage that comes again (a buffer the sender sends again
    and again: empty() memory, or one array sent repeatedly): its next message is handed that
    mapping instead of a new one, emptied first of what a consumer wrote into it in the default
    mode. It keeps the storage's memory alive up to DLPC_CACHE_IDLE_MS (1 s) after the sender
    let go of it; the DLPC_CACHE_* variables bound it, DLPC_CACHE_ENTRIES=0 turns it off
    (see dlpc(3)).
    """

    def __init__(self, name, capacity=0, *, direct=False, client=None):
        self._client = client if client is not None else _client()
        self.name = name
        info = self._client._channel_open(name, capacity, direct)
        self.capacity = info["capacity"]
        self.direct = info["direct"]

    def __repr__(self):
        return (f"dlpack_ipc.Channel({self.name!r}, capacity={self.capacity}"
                f"{', direct=True' if self.direct else ''})")

    def send(self, obj, *, timeout=None):
        """Send obj (anything publish() takes) as one message."""
        self._client._send(self.name, obj, timeout=timeout)

    def send_dict(self, mapping, *, timeout=None):
        """Send a mapping of str keys to tensors as one message (a bundle); keys as for
        publish_dict(), refused with the same errors."""
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
        """The oldest message: a SharedTensor, or a dict of them by key for a bundle."""
        return self._client._recv(self.name, timeout=timeout, mode=mode)

    def recv_dict(self, *, timeout=None, mode=None):
        """The oldest message as a dict by key (a single tensor under the key "")."""
        return self._client._recv(self.name, timeout=timeout, mode=mode, bundle=True)

    def __iter__(self):
        while True:
            try:
                yield self.recv()
            except OSError as e:
                if e.errno in (errno.EIDRM, errno.ENOENT):
                    return
                raise

    def stat(self):
        """This channel as a ChannelInfo."""
        return _channel_info(self._client._channel_stat(self.name))

    def remove(self):
        """Remove the channel: its queued messages are freed (its opener's uid, or root)."""
        self._client._channel_remove(self.name)


def channel(name, capacity=0, *, direct=False, client=None):
    """Open (create unless it exists) the channel name: a Channel (direct: see Channel)."""
    return Channel(name, capacity, direct=direct, client=client)


def channels(prefix=""):
    """Channels whose names start with prefix, sorted by name, as ChannelInfo tuples."""
    return _client().channels(prefix)



def _event(d):
    return WatchEvent(d["kind"], d["name"], d["generation"], d["previous_generation"],
                      d["device"], d["dtype"], d["shape"], d["ntensors"], d["nbytes"], d["refs"],
                      Owner(d["uid"], d["pid"]), d["created"], EntryFlags(d["flags"]), d["reason"],
                      Owner(d["actor_uid"], d["actor_pid"]), d["seq"])


class Watch(_CoreWatch):
    """A watch on the names that start with a prefix: Watch(prefix="", socket=None).

    Iterating yields a WatchEvent per change, in the order the daemon applied them, waiting as
    long as it takes (Ctrl-C interrupts within a tenth of a second). next_event(timeout) waits
    at most timeout seconds and returns None if nothing came. The watch has a connection of its
    own; close() (or leaving a with block) ends it and ends iteration. If the daemon drops the
    watch (it stopped, or this watcher fell more than 1 MiB of events behind) the next read
    raises ConnectionResetError: list() again before watching anew, events may be missing.
    fileno() gives the socket for select()/poll(). One read can bring several events, so the
    socket may stop being readable while events wait: when it is readable, call next_event(0)
    until it returns None (drain()), and only then wait on the socket again.
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
    """Watch the names that start with prefix: an iterator of WatchEvent (see Watch)."""
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
    """Publish obj under name; returns the entry's generation (1, then one more per replace).

    obj: anything with __dlpack__ (numpy, torch, CuPy, JAX), a DLPack capsule, an object with
    the buffer protocol, or a SharedTensor. Host data is copied into sealed shared memory,
    except memory from empty(), which is published as it is. A numpy scalar goes as a 0-d
    array. Of a buffer, the formats with a DLPack dtype are taken (?, b B h H i I l L q Q n N,
    e f d, Zf Zd; native byte order); an object without __dlpack__ whose buffer has another
    format raises TypeError naming it, and one whose buffer does not add up (length, shape)
    ValueError. What DLPack cannot describe (object, string, datetime64 and timedelta64 arrays)
    raises the producer's own error.
    replace: take over a name already published (by this uid, or as root); without it a taken
    name raises FileExistsError. Attachers of the old generation keep its bytes.
    ephemeral: the entry goes when this process's connection closes.
    writable: attachers may map it shared and writable (attach(mode="write")); otherwise the
    memory is sealed read-only for every process, this one included.
    """
    return _client().publish(name, obj, replace=replace, ephemeral=ephemeral, writable=writable)


def publish_dict(name, mapping, *, replace=False, ephemeral=False, writable=False):
    """Publish a mapping of str keys to tensors (a state dict) as one bundle in one storage;
    returns the generation. Values as for publish(); keys are at most KEY_MAX bytes of UTF-8,
    and errors name the key. replace, ephemeral and writable as for publish()."""
    return _client().publish_dict(name, mapping, replace=replace, ephemeral=ephemeral,
                                  writable=writable)


def _entry(client, name):
    """The EntryInfo published under name, or None."""
    return next((e for e in client.list(name) if e.name == name), None)


def _identity(entry):
    """What tells one publish of a name from another: a generation starts again at 1 once the
    name was unpublished, so the creation time and publisher count too."""
    return entry and (entry.generation, entry.created, entry.owner)


def _held(c, name, generation):
    """The body of published(): yield generation, then unpublish it if it is still ours."""
    # what this publish made, seen right after it: None if replaced or gone in between
    mine = _identity(_entry(c, name))
    if mine and mine[0] != generation:
        mine = None
    try:
        yield generation
    finally:
        # a generation that replaced ours, or a name published anew, is not ours to remove
        if mine and _identity(_entry(c, name)) == mine:
            try:
                c.unpublish(name)
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def published(name, obj, *, client=None, ephemeral=True, **publish_kwargs):
    """Publish obj under name for the duration of a with block; yields the generation.

        with dlpack_ipc.published("weights", t):
            ...  # other processes attach "weights" here

    On exit, even by an exception, name is unpublished, unless it is gone already or another
    publish took it over meanwhile (that one is left alone). ephemeral (True here) also
    removes it if this process dies inside the block. Other keywords are publish()'s;
    client: the Client to use (None: the module's default one).
    """
    c = client if client is not None else _client()
    gen = c.publish(name, obj, ephemeral=ephemeral, **publish_kwargs)
    yield from _held(c, name, gen)


@contextlib.contextmanager
def published_dict(name, mapping, *, client=None, ephemeral=True, **publish_kwargs):
    """publish_dict() for the duration of a with block; yields the generation (see
    published())."""
    c = client if client is not None else _client()
    gen = c.publish_dict(name, mapping, ephemeral=ephemeral, **publish_kwargs)
    yield from _held(c, name, gen)


def attach(name, *, timeout=None, mode=None, owner=None, writable=None):
    """Attach the tensor published under name, as a SharedTensor.

    timeout: how long to wait for name to be published: None (or float("inf")) as long as it
    takes (Ctrl-C interrupts), 0 not at all (FileNotFoundError), seconds then TimeoutError.

    mode says how this process maps the memory (None means "read"):
      "read"     (default) the read-only flag is exported, so numpy refuses writes; the memory
                 is mapped copy-on-write, so a consumer that ignores the flag (torch) writes
                 into pages of its own: nobody else sees the write and nothing crashes.
      "private"  writable (no read-only flag), copy-on-write: writes stay in this process.
      "strict"   the read-only flag and a read-only shared mapping: any write is SIGSEGV.
      "write"    shared and writable: writes are seen by every process; the entry must have
                 been published with writable=True. writable=True is the older spelling.
    CUDA entries are shared in place: "read" and "strict" attach them read-only, "private" is
    refused (BufferError).

    owner: a uid; an entry under name published by another uid counts as absent (names are
    first-come across users): FileNotFoundError naming both uids, or a wait goes on until that
    uid publishes. SharedTensor.owner says who published what was attached.
    """
    return _client().attach(name, timeout=timeout, mode=mode, owner=owner, writable=writable)


def attach_dict(name, *, timeout=None, mode=None, owner=None, writable=None):
    """Attach every tensor of a bundle, in one round trip and one mapping, as a dict of
    SharedTensor by key. timeout, mode, writable and owner as for attach()."""
    return _client().attach_dict(name, timeout=timeout, mode=mode, owner=owner,
                                 writable=writable)


def empty(shape, dtype, device="cpu"):
    """Writable shared memory to fill in place; publish() then shares it without a copy.

    device is "cpu", or "cuda" / "cuda:N" for CUDA VMM memory on that device; such memory
    carries no event for attachers to wait on, so finish writing it (synchronize) before
    publishing."""
    return _client().empty(shape, dtype, device)


def empty_dict(spec, device="cpu"):
    """A bundle to fill in place: {key: (shape, dtype)} -> {key: SharedTensor}, every tensor in
    one allocation (each at the next 256-byte boundary) on device ("cpu", "cuda", "cuda:N").
    publish_dict() of that whole dict, in its order, then shares the allocation without a copy,
    on a device too (a weight-sync bucket: synchronize after filling it, before publishing); a
    part of it is copied. On the host a read-only publish makes every tensor of the dict
    read-only, as for empty()."""
    return _client().empty_dict(spec, device)


def unpublish(name):
    """Remove name (its publishing uid, or root, may); attached tensors stay valid until
    released."""
    return _client().unpublish(name)


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
    re-attaches, see dlpc(3)) and invalidations (cache invalidations sent since start)."""
    return _client().stat()
