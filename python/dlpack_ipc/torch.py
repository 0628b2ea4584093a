# SPDX-License-Identifier: Apache-2.0
"""A torch module's weights shared between processes, zero-copy.

    import dlpack_ipc.torch as dt
    dt.share_module(model, "llm/v1")           # once: the state dict, as one bundle

    model = build_model()                      # in each worker (on device="meta": no memory)
    dt.attach_module(model, "llm/v1")          # every parameter and buffer now views the
                                               # published memory; nothing is copied

load_state_dict() would copy the weights into every worker; attach_module() replaces each
parameter and persistent buffer by a tensor over the shared memory instead (torch 1.13 has no
load_state_dict(assign=True), and this needs none). Tied weights (one tensor under two keys of
the state dict, such as an embedding and an output layer) are published once and come back as
one parameter.
"""
import json
import typing
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch

import dlpack_ipc

__all__ = ["share_module", "attach_module", "IncompatibleKeys", "ALIASES_KEY"]

# The bundle's key for the tied weights: JSON bytes {"aliases": {key: the key published}}.
ALIASES_KEY = "__dlpack_ipc_torch_aliases__"


class IncompatibleKeys(typing.NamedTuple):
    """What attach_module() found on one side only (as load_state_dict() reports it)."""
    missing_keys: List[str]
    unexpected_keys: List[str]


def _same_view(t: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """What makes two state dict entries the same tensor (None: never shared, e.g. empty)."""
    if t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def share_module(module: torch.nn.Module, name: str, *, replace: bool = False,
                 ephemeral: bool = False, writable: bool = False,
                 client: Optional[dlpack_ipc.Client] = None) -> int:
    """Publish module.state_dict() under name as one bundle; returns the generation.

    A tensor that appears under several keys (tied weights) is published once; the other keys
    are recorded as its aliases (under ALIASES_KEY) and attach_module() ties them again.
    replace, ephemeral and writable are publish()'s; client defaults to the module's.
    """
    tensors: Dict[str, Any] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[Tuple[Any, ...], str] = {}
    for key, value in module.state_dict().items():
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
        tensors[key] = value
    if ALIASES_KEY in tensors:
        raise ValueError(f"cannot share: the state dict uses the reserved key {ALIASES_KEY!r}")
    if aliases:
        tensors[ALIASES_KEY] = json.dumps({"aliases": aliases}).encode()
    return (client or dlpack_ipc).publish_dict(name, tensors, replace=replace,
                                               ephemeral=ephemeral, writable=writable)


_Slot = Tuple[str, torch.nn.Module, str, bool, torch.Tensor]


def _slots(module: torch.nn.Module, prefix: str = "") -> typing.Iterator[_Slot]:
    """(key, module, attribute, is_parameter, tensor) for what state_dict() would hold: each
    parameter and persistent buffer, under every path that reaches it."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield prefix + attr, module, attr, True, p
    for attr, b in module._buffers.items():
        if b is not None and attr not in module._non_persistent_buffers_set:
            yield prefix + attr, module, attr, False, b
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _slots(child, prefix + child_name + ".")


def attach_module(module: torch.nn.Module, name: str, *, timeout: Optional[float] = None,
                  mode: Optional[Literal["read", "private", "strict", "write"]] = None,
                  owner: Optional[int] = None,
                  requires_grad: bool = False, strict: bool = True,
                  client: Optional[dlpack_ipc.Client] = None) -> IncompatibleKeys:
    """Make every parameter and persistent buffer of module a view of the bundle published
    under name (by share_module() or publish_dict() of a state dict): zero-copy.

    module may be built on device="meta" (it then allocates nothing) or as usual (its own
    tensors are dropped). Shapes and dtypes must match the module's. Parameters become
    torch.nn.Parameter(shared, requires_grad=requires_grad); what the module ties (one
    parameter under two names) and what the publisher tied stays one tensor. Non-persistent
    buffers are not in a state dict and stay the module's own.

    timeout, mode and owner are attach()'s: with mode "read" (the default) a write, such as
    an optimizer step, copies the pages it touches into this process (nobody else sees it).
    strict: keys found on one side only raise KeyError before anything is replaced; with
    strict=False they are returned, and the module's missing ones left as they were.
    """
    shared = (client or dlpack_ipc).attach_dict(name, timeout=timeout, mode=mode, owner=owner)
    meta = shared.pop(ALIASES_KEY, None)
    aliases = json.loads(meta.torch().numpy().tobytes())["aliases"] if meta is not None else {}
    tensors = {key: t.torch() for key, t in shared.items()}
    for key, target in aliases.items():
        tensors[key] = tensors[target]
    slots = list(_slots(module))
    keys = {s[0] for s in slots}
    missing = [s[0] for s in slots if s[0] not in tensors]
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
            new = torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t
        by_old[id(old)] = by_new[id(t)] = new
        if is_param:
            owner_module._parameters[attr] = new
        else:
            owner_module._buffers[attr] = new
    return IncompatibleKeys(missing, unexpected)
