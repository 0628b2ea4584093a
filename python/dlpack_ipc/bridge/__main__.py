# SPDX-License-Identifier: Apache-2.0
"""python3 -m dlpack_ipc.bridge: the dlpackd-bridge daemon (docs/bridge.md)."""
import argparse
import logging
import os
import signal
import sys

from . import default_socket

# UCX's defaults that do not suit the bridge, each kept where the operator set it: TCP only
# (left alone, UCX would use cross-memory attach between processes of one host, even across
# network namespaces), without UCX's InfiniBand modules (the wheel's bundled netlink library
# crashes the process at exit), and a TCP keepalive that closes a dead peer's data connection
# within UCX_KEEPALIVE_DEAD seconds, well inside --quarantine: after that no late WRITE can land
# in memory the bridge gave back (docs/bridge.md, "Leases and quarantine").
UCX_DEFAULTS = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib", "UCX_TCP_KEEPIDLE": "5s",
                "UCX_TCP_KEEPINTVL": "2s", "UCX_TCP_KEEPCNT": "3"}


def _seconds(text):
    """A UCX time value ("5s", "500ms", "2") in seconds; None for "inf" or what is not one."""
    text = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0), ("m", 60.0), ("", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[:len(text) - len(suffix)]) * scale
            except ValueError:
                return None
    return None


def keepalive_dead():
    """Seconds after which UCX closes a silent dead data connection, from the environment."""
    idle = _seconds(os.environ.get("UCX_TCP_KEEPIDLE", "10s"))
    intvl = _seconds(os.environ.get("UCX_TCP_KEEPINTVL", "2s"))
    cnt = _seconds(os.environ.get("UCX_TCP_KEEPCNT", "3"))
    if idle is None or intvl is None or cnt is None:
        return None
    return idle + intvl * cnt


def _args(argv):
    p = argparse.ArgumentParser(
        prog="python3 -m dlpack_ipc.bridge",
        description="Make dlpackd names reachable from other hosts over NIXL: serve the "
        "exported ones to authenticated peers, and fetch peers' names into the local dlpackd "
        "for local clients (dlpack_ipc.bridge.fetch).")
    p.add_argument("--listen", metavar="ADDR:PORT",
                   help="accept peer bridges here (default: none, export nothing)")
    p.add_argument("--peer", action="append", metavar="NAME=ADDR:PORT",
                   help="a peer bridge whose names are fetched as NAME:name (repeatable)")
    p.add_argument("--export", action="append", metavar="PREFIX",
                   help="serve names starting with PREFIX to peers (repeatable; none: nothing)")
    p.add_argument("--follow", action="append", metavar="PEER:NAME",
                   help="keep a replica of PEER's NAME fresh: fetch it again whenever its "
                   "generation changes there, unpublish it when it goes (repeatable)")
    p.add_argument("--follow-interval", metavar="SECONDS", type=float, default=1.0,
                   help="how often --follow asks the peer for the generation (default 1)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the token shared by all bridges (mode 0600 or stricter); needed with "
                   "--listen or --peer")
    p.add_argument("--socket", metavar="PATH", default=None,
                   help=f"the local clients' socket (default {default_socket()})")
    p.add_argument("--socket-mode", metavar="MODE", default="0660",
                   help="permissions of the local socket, in octal (default 0660)")
    p.add_argument("--dlpackd-socket", metavar="PATH", default=None,
                   help="the local dlpackd (default: dlpack_ipc's default socket)")
    p.add_argument("--lease-ttl", metavar="SECONDS", type=float, default=None,
                   help="how long an exported entry is held for a peer that has not taken it, "
                   "and the longest one transfer may take (default 30)")
    p.add_argument("--quarantine", metavar="SECONDS", type=float, default=None,
                   help="how long memory of an aborted transfer stays registered and mapped "
                   "before it is given back (default 60)")
    p.add_argument("--progress-thread", action="store_true",
                   help="let NIXL run its progress thread (it spins: on few cores, slower)")
    p.add_argument("--log-level", default="info",
                   choices=["err", "warning", "notice", "info", "debug"])
    return p.parse_args(argv)


def main(argv=None):
    args = _args(argv)
    for k, v in UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from . import _server, _wire  # imports NIXL's dependencies only here

    level = {"err": logging.ERROR, "warning": logging.WARNING, "notice": logging.INFO,
             "info": logging.INFO, "debug": logging.DEBUG}[args.log_level]
    _server._logging(level)
    log = _server.log
    if args.lease_ttl is None:
        args.lease_ttl = _server.LEASE_TTL
    if args.quarantine is None:
        args.quarantine = _server.QUARANTINE
    if not args.quarantine >= 0:
        log.error("--quarantine %s: must be >= 0", args.quarantine)
        return 2
    dead = keepalive_dead()
    if dead is None or args.quarantine <= dead:
        log.error("--quarantine %s s must exceed the time UCX's TCP keepalive takes to drop a "
                  "dead peer (UCX_TCP_KEEPIDLE + UCX_TCP_KEEPINTVL * UCX_TCP_KEEPCNT = %s)",
                  args.quarantine, "never" if dead is None else f"{dead:g} s")
        return 2
    if not args.follow_interval > 0:
        log.error("--follow-interval %s: must be > 0", args.follow_interval)
        return 2
    if not args.lease_ttl > 0:
        log.error("--lease-ttl %s: must be > 0", args.lease_ttl)
        return 2
    token = None
    if args.listen or args.peer:
        if not args.token_file:
            log.error("--listen and --peer need --token-file")
            return 2
        try:
            token = _wire.read_token(args.token_file)
        except (OSError, ValueError) as e:
            log.error("%s", e)
            return 1
    try:
        mode = int(args.socket_mode, 8)
        bridge = _server.Bridge(args, token)
        tcp = _server._listen_tcp(args.listen) if args.listen else None
        path = args.socket or default_socket()
        unix = _server._listen_unix(path, mode)
    except ImportError as e:
        log.error("cannot start: NIXL cannot be imported (%s): install the extra 'bridge' "
                  "(docs/bridge.md, Install)", e)
        return 1
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: bridge.stop.set())
    signal.signal(signal.SIGINT, lambda *_: bridge.stop.set())
    log.info("agent %s; listening on %s; peers %s; exporting %s; local socket %s",
             bridge.agent_name, args.listen or "nothing", ", ".join(args.peer or []) or "none",
             ", ".join(args.export or []) or "nothing", path)
    try:
        bridge.serve(tcp, unix)
    finally:
        if tcp is not None:
            tcp.close()
        unix.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
