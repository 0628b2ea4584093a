# SPDX-License-Identifier: Apache-2.0
"""A torch module's weights shared between processes, zero-copy; and kept in step with a trainer.

    import dlpack_ipc.torch as dt
    dt.share_module(model, "llm/v1")           # once: every parameter and buffer, one bundle

    model = build_model(device="meta")         # in each worker: no memory for weights...
    dt.attach_module(model, "llm/v1")          # ...every parameter and buffer now views the
                                               # published memory; nothing is copied

    f = dt.follow(model, "policy")             # a worker that follows a trainer, which calls
    while True:                                # dt.share_module(net, "policy", replace=True)
        f.update()                             # newest generation, between forward passes
        model(x)

share_module()   publish a module's parameters and buffers (non-persistent ones too) as a bundle
attach_module()  make a module's parameters and buffers views of such a bundle
follow()         a Follower: attach_module() now, then swap to each newer generation on update()
to_shared()      move a module into dlpackd memory, so that share_module() publishes it as it is

load_state_dict() would copy the weights into every worker; attach_module() replaces each
parameter and buffer by a tensor over the shared memory instead (torch 1.13 has no
load_state_dict(assign=True), and this needs none). Tied weights (one tensor under two keys of
the state dict, such as an embedding and an output layer) are published once and come back as
one parameter. Non-persistent buffers (such as a BERT's position_ids, which are not in a state
dict) are published under NONPERSISTENT_PREFIX + their state-dict-style key.
"""
import json
import select
import threading
import time
import typing
import weakref
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch

import dlpack_ipc

__all__ = ["share_module", "attach_module", "follow", "Follower", "to_shared",
           "IncompatibleKeys", "ALIASES_KEY", "NONPERSISTENT_PREFIX"]

# The bundle's key for the tied weights: JSON bytes {"aliases": {key: the key published}}.
ALIASES_KEY = "__dlpack_ipc_torch_aliases__"
# The prefix of the bundle's keys for non-persistent buffers: NONPERSISTENT_PREFIX + "emb.pos".
NONPERSISTENT_PREFIX = "__dlpack_ipc_torch_nonpersistent__/"

_Mode = Optional[Literal["read", "private", "strict", "write"]]


class IncompatibleKeys(typing.NamedTuple):
    """What attach_module() found on one side only (as load_state_dict() reports it)."""
    missing_keys: List[str]
    unexpected_keys: List[str]


def _same_view(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """What makes two state dict entries the same tensor (None: never shared, e.g. empty)."""
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _nonpersistent(module: torch.nn.Module,
                   prefix: str = "") -> typing.Iterator[Tuple[str, torch.Tensor]]:
    """(key, buffer) for each non-persistent buffer, under every path that reaches it, with
    the keys a state dict would give it."""
    for attr, b in module._buffers.items():
        if b is not None and attr in module._non_persistent_buffers_set:
            yield prefix + attr, b
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _nonpersistent(child, prefix + child_name + ".")


def _bundle(module: torch.nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors share_module() publishes, by bundle key and in its order (the state dict's,
    then the non-persistent buffers), each tensor once; and the aliases of the other keys."""
    items: List[Tuple[str, Any]] = list(module.state_dict(keep_vars=True).items())
    items += [(NONPERSISTENT_PREFIX + k, b) for k, b in _nonpersistent(module)]
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[Tuple[Any, ...], str] = {}
    for key, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"cannot share {key!r}: {type(value).__name__} is not a tensor "
                            "(extra state cannot be shared)")
        if value.device.type == "meta":
            raise ValueError(f"cannot share {key!r}: it is on device 'meta' (no data)")
        ident = _same_view(value)
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        tensors[key] = value.detach()
    if ALIASES_KEY in tensors:
        raise ValueError(f"cannot share: the state dict uses the reserved key {ALIASES_KEY!r}")
    return tensors, aliases


def _aliases_record(aliases: Dict[str, str]) -> bytes:
    return json.dumps({"aliases": aliases}, sort_keys=True).encode()


# to_shared()'s modules: their bucket, as SharedTensors by bundle key (libdlpc publishes its
# own views of an allocation as they are; torch's re-export of them would be copied)
_buckets: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, dlpack_ipc.SharedTensor]]" = \
    weakref.WeakKeyDictionary()


def _in_bucket(module: torch.nn.Module, out: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The bucket of to_shared(module) if out is exactly it, key by key, else None."""
    held = _buckets.get(module)
    if held is None or list(held) != list(out):
        return None
    for key, t in out.items():
        if isinstance(t, bytes):
            if held[key].torch().numpy().tobytes() != t:
                return None
        elif t.data_ptr() != held[key].data_ptr:
            return None
    return dict(held)


def share_module(module: torch.nn.Module, name: str, *, replace: bool = False,
                 ephemeral: bool = False, writable: bool = False,
                 client: Optional[dlpack_ipc.Client] = None) -> int:
    """Publish every parameter and buffer of module under name as one bundle; returns the
    generation.

    The bundle holds module.state_dict() and the non-persistent buffers (under
    NONPERSISTENT_PREFIX + key), so that attach_module() leaves nothing on device "meta".
    A tensor that appears under several keys (tied weights) is published once; the other keys
    are recorded as its aliases (under ALIASES_KEY) and attach_module() ties them again.
    The tensors are copied into sealed shared memory, except for a module that to_shared()
    moved into dlpackd memory, whose bucket is published as it is (then read-only: see
    to_shared()). replace=True publishes a new generation of name (the trainer's side of
    follow()); replace, ephemeral and writable are publish()'s; client defaults to the
    module's.
    """
    tensors, aliases = _bundle(module)
    out: Dict[str, Any] = dict(tensors)
    if aliases:
        out[ALIASES_KEY] = _aliases_record(aliases)
    out = _in_bucket(module, out) or out
    return (client or dlpack_ipc).publish_dict(name, out, replace=replace,
                                               ephemeral=ephemeral, writable=writable)


def to_shared(module: torch.nn.Module, *,
              client: Optional[dlpack_ipc.Client] = None) -> torch.nn.Module:
    """Move every parameter and buffer of module into one new allocation of dlpackd memory
    (dlpack_ipc.empty_dict()), laid out as share_module() publishes it; returns module.

    The values are copied once; parameters stay the same Parameter objects (their .data
    moves), so an optimizer holding them goes on working. The next share_module() of module
    then publishes that memory as it is, with no copy, and from then on it is read-only for
    this process too (a write, such as an optimizer step, is a segmentation fault): call
    to_shared() again before writing (a trainer: train, to_shared(), share_module(...,
    replace=True), train...).
    """
    tensors, aliases = _bundle(module)
    spec: Dict[str, Any] = {k: (tuple(t.shape), _dtype_name(k, t)) for k, t in tensors.items()}
    record = _aliases_record(aliases) if aliases else None
    if record is not None:
        spec[ALIASES_KEY] = ((len(record),), "uint8")
    bucket = (client or dlpack_ipc).empty_dict(spec)
    moved: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in tensors.items():
            new = bucket[key].torch()
            new.copy_(t)
            moved[id(t)] = new
        if record is not None:
            bucket[ALIASES_KEY].torch().copy_(torch.tensor(list(record), dtype=torch.uint8))
    _buckets[module] = bucket
    for key, owner_module, attr, is_param, old in _slots(module, nonpersistent=True):
        src = tensors.get(aliases.get(key, key))
        if src is None:
            continue
        if is_param:
            old.data = moved[id(src)]
        else:
            owner_module._buffers[attr] = moved[id(src)]
    return module


def _dtype_name(key: str, t: torch.Tensor) -> str:
    name = str(t.dtype).replace("torch.", "")
    if name not in {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                    "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                    "complex128"}:
        raise TypeError(f"cannot move {key!r} to dlpackd memory: dtype {t.dtype}")
    return name


_Slot = Tuple[str, torch.nn.Module, str, bool, torch.Tensor]


def _slots(module: torch.nn.Module, prefix: str = "", *,
           nonpersistent: bool = False) -> typing.Iterator[_Slot]:
    """(key, module, attribute, is_parameter, tensor) for what state_dict() would hold, each
    parameter and persistent buffer under every path that reaches it; with nonpersistent=True
    the non-persistent buffers too, under NONPERSISTENT_PREFIX + key."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield prefix + attr, module, attr, True, p
    for attr, b in module._buffers.items():
        if b is None:
            continue
        if attr not in module._non_persistent_buffers_set:
            yield prefix + attr, module, attr, False, b
        elif nonpersistent:
            yield NONPERSISTENT_PREFIX + prefix + attr, module, attr, False, b
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _slots(child, prefix + child_name + ".", nonpersistent=nonpersistent)


def _tensors(shared: Dict[str, "dlpack_ipc.SharedTensor"]) -> Dict[str, torch.Tensor]:
    """The bundle's tensors by key, each alias key on the tensor of its target."""
    meta = shared.pop(ALIASES_KEY, None)
    aliases = json.loads(meta.torch().numpy().tobytes())["aliases"] if meta is not None else {}
    tensors = {key: t.torch() for key, t in shared.items()}
    for key, target in aliases.items():
        tensors[key] = tensors[target]
    return tensors


def _plan(module: torch.nn.Module, name: str, tensors: Dict[str, torch.Tensor],
          strict: bool) -> Tuple[List[_Slot], IncompatibleKeys]:
    """Check tensors against module before anything is replaced: the slots, and the keys found
    on one side only. Raises what attach_module() documents."""
    slots = list(_slots(module, nonpersistent=True))
    keys = {s[0] for s in slots}
    # a non-persistent buffer the bundle lacks (a plain state dict's) is not a missing key:
    # the module's own stays, unless it is on meta (below)
    missing = [s[0] for s in slots if s[0] not in tensors and
               not s[0].startswith(NONPERSISTENT_PREFIX)]
    unexpected = sorted(k for k in tensors if k not in keys)
    if strict and (missing or unexpected):
        raise KeyError(f"cannot attach {name!r} to {type(module).__name__}: missing keys "
                       f"{missing}, unexpected keys {unexpected}")
    bad = [f"{key}: {tuple(old.shape)} {old.dtype} in the module, "
           f"{tuple(tensors[key].shape)} {tensors[key].dtype} in {name!r}"
           for key, _, _, _, old in slots if key in tensors and
           (old.shape != tensors[key].shape or old.dtype != tensors[key].dtype)]
    if bad:
        raise ValueError("cannot attach: " + "; ".join(bad))
    # nothing may stay on meta: a tensor with no data fails only at the first forward pass
    replaced = {id(old) for key, _, _, _, old in slots if key in tensors}
    stays = [key[len(NONPERSISTENT_PREFIX):] + " (non-persistent buffer)"
             if key.startswith(NONPERSISTENT_PREFIX) else key
             for key, _, _, _, old in slots if old.is_meta and id(old) not in replaced]
    if stays:
        raise ValueError(f"cannot attach {name!r} to {type(module).__name__}: "
                         f"{', '.join(stays)} would stay on device 'meta' ({name!r} does not "
                         "hold them; share_module() publishes non-persistent buffers too)")
    return slots, IncompatibleKeys(missing, unexpected)


def _bind(slots: List[_Slot], tensors: Dict[str, torch.Tensor], requires_grad: bool) -> None:
    """Put tensors in place of the slots' parameters and buffers, keeping ties."""
    by_old: Dict[int, torch.Tensor] = {}  # the module's own ties
    by_new: Dict[int, torch.Tensor] = {}  # the publisher's
    for key, owner_module, attr, is_param, old in slots:
        if key not in tensors:
            continue
        t = tensors[key]
        new = by_old.get(id(old))
        if new is None:
            new = by_new.get(id(t))
        if new is None:
            # only floating-point and complex tensors can require gradients: an integer
            # parameter stays without, as torch lets a module have it
            grad = requires_grad and (t.is_floating_point() or t.is_complex())
            new = torch.nn.Parameter(t, requires_grad=grad) if is_param else t
        by_old[id(old)] = by_new[id(t)] = new
        if is_param:
            owner_module._parameters[attr] = new
        else:
            owner_module._buffers[attr] = new
    # a tie the bundle holds under one of its keys only: the other path follows
    for key, owner_module, attr, is_param, old in slots:
        if key not in tensors and id(old) in by_old:
            if is_param:
                owner_module._parameters[attr] = by_old[id(old)]
            else:
                owner_module._buffers[attr] = by_old[id(old)]


def attach_module(module: torch.nn.Module, name: str, *, timeout: Optional[float] = None,
                  mode: _Mode = None, owner: Optional[int] = None,
                  requires_grad: bool = False, strict: bool = True,
                  client: Optional[dlpack_ipc.Client] = None,
                  populate: bool = True) -> IncompatibleKeys:
    """Make every parameter and buffer of module a view of the bundle published under name
    (by share_module(), or publish_dict() of a state dict): zero-copy.

    module may be built on device="meta" (it then allocates nothing) or as usual (its own
    tensors are dropped). Shapes and dtypes must match the module's. Parameters become
    torch.nn.Parameter(shared, requires_grad=requires_grad) (requires_grad=False for those that
    are not floating-point or complex, which cannot require gradients); what the module ties (one
    parameter under two names) and what the publisher tied stays one tensor. Non-persistent
    buffers come from the bundle when share_module() published it; a bundle without them
    (publish_dict() of a state dict) leaves the module's own.

    Nothing stays on device "meta": a parameter or buffer that is on meta and that the bundle
    does not hold raises ValueError naming it, before anything is replaced.
    timeout, mode and owner are attach()'s: with mode "read" (the default) a write, such as
    an optimizer step, copies the pages it touches into this process (nobody else sees it).
    strict: keys found on one side only raise KeyError before anything is replaced; with
    strict=False they are returned, and the module's missing ones left as they were.
    populate: attach_dict()'s, on by default: a forward pass reads every weight, so the
    mapping is faulted in before this returns, and the first forward pass takes no page
    faults for it (False: the first pass faults the weights in as it reads them). Its cost is
    in this call, for every page of the whole bundle: about 15 ms per 400 MiB with 4 KiB
    pages on two CPUs (25-35 ms on one), a fraction of a millisecond with shmem huge pages.
    Pass populate=False for a worker that reads only part of the weights (the experts of a
    mixture-of-experts model it runs).
    """
    shared = (client or dlpack_ipc).attach_dict(name, timeout=timeout, mode=mode, owner=owner,
                                                populate=populate)
    tensors = _tensors(shared)
    slots, result = _plan(module, name, tensors, strict)
    _bind(slots, tensors, requires_grad)
    return result


class Follower:
    """A module kept bound to the newest generation of the bundle published under a name:
    made by follow(). A context manager.

    update() swaps every parameter and buffer at once to the newest generation, if a newer
    one was published (the trainer's share_module(..., replace=True)), and returns True; else
    it returns False at once (no round trip: it reads the events of a watch on the name).
    Call it between forward passes. With several threads, run each forward pass inside
    `with follower:` instead: entering swaps to the newest generation unless another thread
    is inside, and until the block ends no swap happens (update() from another thread waits
    for every block to end), so a forward pass never sees half of one generation and half of
    the next. A generation's memory is freed once no tensor of it is referenced any more
    (the module's were swapped, and nothing else holds one). Each generation's parameters are
    new Parameter objects: what holds the old ones (an optimizer) keeps the old generation.

    generation is the generation the module is bound to; name and module as given. close()
    stops following (a `with` block holds a generation, it does not close); the module keeps
    the tensors it has.
    """

    def __init__(self, module: torch.nn.Module, name: str, *, timeout: Optional[float],
                 mode: _Mode, owner: Optional[int], requires_grad: bool, strict: bool,
                 socket: Optional[str], populate: bool = True) -> None:
        self.module = module
        self.name = name
        self._mode = mode
        self._owner = owner
        self._populate = populate
        self._requires_grad = requires_grad
        self._strict = strict
        self._socket = socket
        self._client: Any = (dlpack_ipc if socket is None
                             else dlpack_ipc.Client(socket, reconnect=True))
        self._cond = threading.Condition()
        self._inside = 0  # threads inside `with self:`
        self._local = threading.local()
        self._stale = False  # an event said a newer generation may be there
        self._gone = False  # an event said the name was unpublished since our attach
        self.generation = 0
        # the watch first: a generation published after the attach below is an event
        self._watch: Optional[dlpack_ipc.Watch] = dlpack_ipc.watch(name, socket=socket)
        try:
            self.generation = self._attach(timeout)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return (f"<dlpack_ipc.torch.Follower {self.name!r} generation={self.generation} "
                f"of {type(self.module).__name__}{' closed' if self._watch is None else ''}>")

    def _attach(self, timeout: Optional[float]) -> int:
        shared = self._client.attach_dict(self.name, timeout=timeout, mode=self._mode,
                                          owner=self._owner, populate=self._populate)
        generation = next(iter(shared.values())).generation if shared else 0
        tensors = _tensors(shared)
        slots, _ = _plan(self.module, self.name, tensors, self._strict)
        _bind(slots, tensors, self._requires_grad)
        return int(generation)

    def _newer(self) -> bool:
        """Whether the watch saw a generation other than ours published since."""
        if self._watch is None:
            raise ValueError(f"{self!r}: closed")
        try:
            events = self._watch.drain()
        except ConnectionResetError:
            # the daemon dropped the watch (restarted, or we fell 1 MiB of events behind):
            # watch anew and look
            self._watch.close()
            self._watch = dlpack_ipc.watch(self.name, socket=self._socket)
            self._stale = True
            events = []
        for ev in events:
            if ev.name != self.name:
                continue
            if ev.kind == "unpublished":
                self._gone = True  # published again, it starts over at generation 1
            elif ev.kind in ("published", "replaced") and (self._gone or
                                                           ev.generation != self.generation):
                self._stale = True
        return self._stale

    def _update(self) -> bool:
        if not self._newer():
            return False
        try:
            shared = self._client.attach_dict(self.name, timeout=0, mode=self._mode,
                                              owner=self._owner, populate=self._populate)
        except FileNotFoundError:
            self._stale = False  # unpublished again: keep what we have
            return False
        self._stale = self._gone = False
        generation = int(next(iter(shared.values())).generation) if shared else 0
        tensors = _tensors(shared)
        slots, _ = _plan(self.module, self.name, tensors, self._strict)
        _bind(slots, tensors, self._requires_grad)
        self.generation = generation
        return True

    def update(self, timeout: Optional[float] = 0) -> bool:
        """Swap to the newest generation if a newer one was published: True if it swapped.

        timeout: how long to wait for a newer generation when there is none yet (0, the
        default: not at all; None: as long as it takes; else seconds), for a worker that
        has nothing to do until then. A newer generation that does not fit the module
        (keys, shapes, dtypes) raises as attach_module() does, and the module keeps the
        generation it has. Called from a thread inside `with self:` it raises RuntimeError
        (it would wait for itself)."""
        if getattr(self._local, "depth", 0):
            raise RuntimeError(f"{self!r}: update() inside `with` of the same thread")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while self._inside:
                    self._cond.wait()
                if self._update():
                    return True
                watch = self._watch
            left = None if deadline is None else deadline - time.monotonic()
            if watch is None or (left is not None and left <= 0):
                return False
            # every event read was drained above: wait for the socket, then look again
            select.select([watch], [], [], left)

    def __enter__(self) -> "Follower":
        with self._cond:
            if not self._inside:
                self._update()
            self._inside += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._local.depth -= 1
        with self._cond:
            self._inside -= 1
            if not self._inside:
                self._cond.notify_all()

    def close(self) -> None:
        """Stop following: end the watch (and the connection of a socket= follower). The
        module keeps the generation it is bound to."""
        with self._cond:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            if isinstance(self._client, dlpack_ipc.Client):
                self._client.close()


def follow(module: torch.nn.Module, name: str, *, timeout: Optional[float] = None,
           mode: _Mode = None, owner: Optional[int] = None, requires_grad: bool = False,
           strict: bool = True, socket: Optional[str] = None,
           populate: bool = True) -> Follower:
    """attach_module(module, name) now, and a Follower whose update() (or `with`) swaps the
    module to each newer generation published under name.

    The publisher (a trainer) calls share_module(net, name, replace=True) for each new set of
    weights; module may be built on device="meta". timeout, mode, owner, requires_grad,
    strict and populate are attach_module()'s (timeout for the first generation only: later
    ones are taken when they are there; populate for every generation, so that update() takes
    the faults and the next forward pass none: populating the whole bundle costs about 20-40 ms
    per 400 MiB with 4 KiB pages, a fraction of a millisecond with shmem huge pages, in this call
    and in each update() that swaps; populate=False for a worker that reads only part of the
    weights, such as a mixture-of-experts model's experts). socket: the daemon's (None: the
    default one, and the module's default client).
    """
    return Follower(module, name, timeout=timeout, mode=mode, owner=owner,
                    requires_grad=requires_grad, strict=strict, socket=socket,
                    populate=populate)
