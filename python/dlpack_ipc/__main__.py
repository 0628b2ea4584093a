# SPDX-License-Identifier: Apache-2.0
"""python -m dlpack_ipc: list, remove and watch what a running dlpackd holds (dlpackctl for pip
users). Exit status: 0 success, 1 the operation failed (the reason on stderr), 2 bad usage."""
import argparse
import os
import pwd
import signal
import sys
import time

import dlpack_ipc

PROG = "python -m dlpack_ipc"
EXIT_FAILED = 1


class _Failed(Exception):
    """An operation failed: its one-line reason, already worded."""


def _text(s):
    """s as it may go to a terminal: control and other unprintable characters escaped."""
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def _user(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _size(n):
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    v, u = float(n), 0
    while v >= 1024 and u + 1 < len(units):
        v, u = v / 1024, u + 1
    return f"{n} B" if u == 0 else f"{v:.1f} {units[u]}"


def _age(created):
    s = max(0, int(time.time() - created))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _type(dtype, shape, ntensors):
    if ntensors != 1:
        return f"bundle({ntensors})"
    if dtype is None:
        return "?"
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def _table(head, rows):
    """Print rows under head, each column as wide as its widest cell, two spaces apart."""
    width = [max(len(str(r[k])) for r in [head, *rows]) for k in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, width)).rstrip())


def _reason(e):
    """An OSError's text without the "[Errno N]" Python puts before it."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def _client(args):
    try:
        return dlpack_ipc.Client(args.socket)
    except OSError as e:
        raise _Failed(f"{args.command}: {_reason(e)}") from None


def cmd_ls(args):
    with _client(args) as c:
        try:
            entries = c.list(args.prefix)
        except (OSError, ValueError) as e:  # ValueError: a name the library refuses
            raise _Failed(f"ls '{_text(args.prefix)}': {_reason(e)}") from None
    rows = []
    for ent in entries:
        if len(ent.tensors) == 1:
            kind = _type(ent.tensors[0].dtype, ent.tensors[0].shape, 1)
        else:  # no tensors: too large to describe in one reply
            kind = _type(None, (), len(ent.tensors)) if ent.tensors else "?"
        rows.append([_text(ent.name), ent.generation, ent.device, kind, _size(ent.nbytes), ent.refs,
                     ent.cached_refs, f"{_user(ent.owner.uid)}/{ent.owner.pid}",
                     _age(ent.created)])
    _table(["NAME", "GEN", "DEVICE", "TYPE", "SIZE", "REFS", "CACHED", "OWNER", "AGE"], rows)
    return 0


def cmd_rm(args):
    failed = 0
    with _client(args) as c:
        for name in args.names:
            try:
                c.unpublish(name)
            except (OSError, ValueError) as e:  # ValueError: a name the library refuses
                print(f"{PROG}: rm '{_text(name)}': {_reason(e)}", file=sys.stderr)
                failed += 1
    return EXIT_FAILED if failed else 0


def cmd_stat(args):
    with _client(args) as c:
        try:
            st = c.stat()
        except OSError as e:
            raise _Failed(f"stat: {_reason(e)}") from None
    width = max(len(k) for k in st)
    for k, v in st.items():
        print(f"{k.ljust(width)}  {v}")
    return 0


def _state(ch):
    """STATE of channels: "open" or "ended", and once producers are known or several are
    expected, ", C/N closed": C closed of the N closes the end waits for as known now."""
    word = "ended" if ch.ended else "open"
    known = ch.producers + ch.producers_closed
    need = max(ch.producers_expected, known)
    if not known and need <= 1:
        return word
    return f"{word}, {ch.producers_closed}/{need} closed"


def cmd_channels(args):
    with _client(args) as c:
        try:
            chans = c.channels(args.prefix)
        except (OSError, ValueError) as e:  # ValueError: a name the library refuses
            raise _Failed(f"channels '{_text(args.prefix)}': {_reason(e)}") from None
    rows = []
    for ch in chans:
        owner = f"{_user(ch.owner.uid)}/{ch.owner.pid}"
        depth = f"{ch.depth}/{ch.capacity}"
        if ch.direct:  # its messages never pass the daemon: it counts only the queue
            rows.append([_text(ch.name), "direct", depth, "-", "-", "-", "-", _state(ch), owner])
            continue
        waiting = ", ".join(f"{n} {who}" for n, who in ((ch.receivers_waiting, "recv"),
                                                        (ch.senders_waiting, "send")) if n)
        rows.append([_text(ch.name), "queued", depth, _size(ch.bytes_queued), ch.sent, ch.received,
                     waiting or "-", _state(ch), owner])
    _table(["NAME", "KIND", "DEPTH", "QUEUED", "SENT", "RECEIVED", "WAITING", "STATE", "OWNER"],
           rows)
    return 0


def _event_line(ev):
    if ev.kind in ("channel_opened", "channel_removed"):
        return f"{ev.kind:<15} {_text(ev.name)} (by pid {ev.actor.pid})"
    line = f"{ev.kind:<15} {_text(ev.name)} gen {ev.generation}"
    if ev.kind == "replaced":
        line += f" (was {ev.previous_generation})"
    line += (f" {ev.device} {_type(ev.dtype, ev.shape or (), ev.ntensors)} {_size(ev.nbytes)}"
             f" owner {_user(ev.owner.uid)}/{ev.owner.pid}")
    if ev.kind == "unpublished":
        line += (" (publisher disconnected)" if ev.reason == "disconnect"
                 else f" (by pid {ev.actor.pid})")
    return line


def cmd_watch(args):
    try:
        w = dlpack_ipc.Watch(args.prefix, socket=args.socket)
    except (OSError, ValueError) as e:  # ValueError: a name the library refuses
        raise _Failed(f"watch '{_text(args.prefix)}': {_reason(e)}") from None
    with w:
        try:
            for ev in w:
                print(_event_line(ev), flush=True)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _Failed(f"watch '{_text(args.prefix)}': {_reason(e)}") from None
    return 0


def _parser():
    p = argparse.ArgumentParser(
        prog=PROG, description="Look at and manage a running dlpackd (as dlpackctl does).",
        epilog="Exit status: 0 success, 1 the operation failed, 2 usage error.")
    p.add_argument("--socket", metavar="PATH",
                   help="the daemon's socket (default: $DLPACKD_SOCKET, then the per-user "
                        "socket, then the system socket)")
    p.add_argument("-V", "--version", action="version",
                   version=f"dlpack_ipc {dlpack_ipc.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name, fn, help_text):
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS,
                       help="the daemon's socket (as before the command)")
        s.set_defaults(fn=fn)
        return s

    command("ls", cmd_ls, "list the entries whose names start with PREFIX").add_argument(
        "prefix", nargs="?", default="", metavar="PREFIX")
    command("rm", cmd_rm, "unpublish each NAME").add_argument(
        "names", nargs="+", metavar="NAME")
    command("stat", cmd_stat, "show the daemon's counters")
    command("watch", cmd_watch,
            "print publish, replace and unpublish events as they happen (Ctrl-C ends it)"
            ).add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    command("channels", cmd_channels,
            "list the channels whose names start with PREFIX").add_argument(
        "prefix", nargs="?", default="", metavar="PREFIX")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except _Failed as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        # die of the signal, as a C tool does: the shell then knows the user stopped it
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BrokenPipeError as e:  # a reader that went away (| head)
        print(f"{PROG}: {args.command}: cannot write the output: {e.strerror}", file=sys.stderr)
        # nothing more goes there, nor does the interpreter's last flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
