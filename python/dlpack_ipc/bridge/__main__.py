# SPDX-License-Identifier: Apache-2.0
"""python3 -m dlpack_ipc.bridge: the dlpackd-bridge daemon (docs/bridge.md)."""
import argparse
import ipaddress
import logging
import os
import signal
import socket
import subprocess
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


def _local_address(host, port):
    """The address of this host that carries traffic for (host, port): host itself when it is
    one of ours (--listen), else the source address the kernel picks for its route (a UDP
    socket's connect() chooses the route and sends nothing)."""
    family, _, _, _, sa = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(sa)
        return ipaddress.ip_address(s.getsockname()[0].split("%")[0])


def _interfaces():
    """{address: interface} of this host, from `ip -o addr show` (iproute2)."""
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    found = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] in ("inet", "inet6"):
            found[ipaddress.ip_address(f[3].split("/")[0])] = f[1].split("@")[0]
    return found


def net_devices(listen, peers):
    """The interfaces UCX's data path is to use, comma-separated: those that carry --listen's
    address and the routes to the peers (NAME=ADDR:PORT). ValueError saying why when none can
    be found (a wildcard --listen without peers, an address on no interface, no `ip`)."""
    from ._server import parse_addr
    wanted = []
    if listen:
        host, port = parse_addr(listen, "--listen")
        if not ipaddress.ip_address(socket.getaddrinfo(host, port)[0][4][0]).is_unspecified:
            wanted.append((host, port))
    for p in peers or []:
        wanted.append(parse_addr(p.partition("=")[2], f"--peer {p}"))
    if not wanted:
        raise ValueError("--listen is a wildcard address and there is no --peer")
    try:
        ifaces = _interfaces()
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"cannot list this host's interfaces with `ip -o addr show`: {e}") \
            from None
    devices = []
    for host, port in wanted:
        try:
            addr = _local_address(host, port)
        except OSError as e:
            raise ValueError(f"no route to {host}: {e}") from None
        if addr not in ifaces:
            raise ValueError(f"{addr} (for {host}) is on no interface that `ip` lists")
        if ifaces[addr] not in devices:
            devices.append(ifaces[addr])
    return ",".join(devices)


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


def size(text):
    """A size for --replica-bytes-per-uid and --staging-max: bytes, or with a K, M, G or T
    suffix (binary, as dlpackd's --max-bytes-per-uid); argparse's error when it is not one."""
    t = text.strip().upper()
    shift = {"K": 10, "M": 20, "G": 30, "T": 40}.get(t[-1:], 0)
    digits = t[:-1] if shift else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or with K, M, G, T)")
    return int(digits) << shift


def cuda_device(text):
    """--cuda-device: a device ordinal, or None for 'none'; argparse's error otherwise."""
    if text.strip().lower() == "none":
        return None
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) > 1023:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CUDA device ordinal or 'none'")
    return int(text)


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
                   help="keep a replica of PEER's NAME fresh: subscribe to it there, fetch it "
                   "again as soon as the peer pushes a change, unpublish it when it goes; "
                   "poll where the peer refuses the subscription; PEER is a --peer, or a "
                   "bridge registered in --registry (repeatable)")
    p.add_argument("--follow-interval", metavar="SECONDS", type=float, default=1.0,
                   help="how often --follow asks the peer for the generation while no "
                   "subscription is live (the peer refused it, or cannot be reached: then "
                   "tried again at once, then after 1 s, doubling up to the larger of this "
                   "and 1 s, at most RESUBSCRIBE_MAX, 60 s) (default 1)")
    p.add_argument("--follow-subscribed-interval", metavar="SECONDS", type=float, default=None,
                   help="how often --follow still asks while the peer pushes changes, for a "
                   "push lost with a connection (default FOLLOW_SUBSCRIBED_INTERVAL, 30)")
    p.add_argument("--registry", metavar="URL",
                   help="etcd's client URL (http:// or https://): with --listen, keep this "
                   "bridge's record there under --name while it runs; fetch NAME:name from a "
                   "NAME registered there when there is no --peer NAME (docs/bridge.md)")
    p.add_argument("--registry-prefix", metavar="PREFIX", default=None,
                   help="the keys of the records start with this (default /dlpackd-bridge/)")
    p.add_argument("--registry-auth-file", metavar="PATH",
                   help="USER:PASSWORD for etcd, on the first line (mode 0600 or stricter)")
    p.add_argument("--registry-ttl", metavar="SECONDS", type=int, default=None,
                   help="how long the record outlives a bridge that died (default "
                   "REGISTRY_TTL, 10)")
    p.add_argument("--registry-names", action="store_true",
                   help="with --listen, also write in the registry each exported name this "
                   "host's dlpackd holds, so that peers fetch it as *:name")
    p.add_argument("--name", metavar="NAME", default=None,
                   help="this bridge's name in the registry, which peers fetch as NAME:name "
                   "(default: the host name)")
    p.add_argument("--advertise", metavar="ADDR:PORT", default=None,
                   help="the address peers connect to, written in the registry (default: "
                   "--listen's, which must then not be a wildcard)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the token shared by all bridges (mode 0600 or stricter); needed with "
                   "--listen, --peer or --registry")
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
    p.add_argument("--replicas-per-uid", metavar="N", type=int, default=None,
                   help="live replicas one local uid's fetches may hold (default "
                   "REPLICAS_PER_UID_MAX, 64)")
    p.add_argument("--replica-bytes-per-uid", metavar="SIZE", type=size, default=None,
                   help="their bytes, with K, M, G or T for binary multiples (default "
                   "REPLICA_BYTES_PER_UID_MAX, 256G)")
    p.add_argument("--cuda-device", metavar="N", type=cuda_device, default=0,
                   help="the local CUDA device that replicas of peers' device entries are "
                   "allocated on, or 'none' to take no device entries from peers (default 0)")
    p.add_argument("--staging-max", metavar="SIZE", type=size, default=None,
                   help="host memory that device entries served to peers are copied to at "
                   "once, with K, M, G or T (default STAGING_MAX, 8G)")
    p.add_argument("--state-dir", metavar="DIR",
                   default=(os.environ.get("STATE_DIRECTORY") or "").split(":")[0] or None,
                   help="where the bridge keeps which uid's fetch made each replica, across "
                   "restarts (default $STATE_DIRECTORY, which systemd's StateDirectory= sets; "
                   "none: in memory only)")
    p.add_argument("--progress-thread", action="store_true",
                   help="let NIXL run its progress thread (it spins: on few cores, slower)")
    p.add_argument("--log-level", default="info",
                   choices=["err", "warning", "notice", "info", "debug"])
    return p.parse_args(argv)


def main(argv=None):
    args = _args(argv)
    for k, v in UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from . import _push, _server, _wire  # imports NIXL's dependencies only here

    level = {"err": logging.ERROR, "warning": logging.WARNING, "notice": logging.INFO,
             "info": logging.INFO, "debug": logging.DEBUG}[args.log_level]
    _server._logging(level)
    log = _server.log
    # A NIXL agent opens UCX's TCP data ports on every interface UCX may use, and whoever
    # reaches them can read and write the registered memory (no key is checked): keep them on
    # the interfaces the bridge's own traffic takes, unless the operator chose.
    if "UCX_NET_DEVICES" in os.environ:
        log.info("UCX_NET_DEVICES=%s (set by the environment)", os.environ["UCX_NET_DEVICES"])
    elif args.listen or args.peer:
        if args.registry:
            log.info("peers found in the registry are reached over the interfaces of --listen "
                     "and --peer only: set UCX_NET_DEVICES where they take others")
        try:
            os.environ["UCX_NET_DEVICES"] = net_devices(args.listen, args.peer)
            log.info("UCX_NET_DEVICES=%s: UCX's data ports only there",
                     os.environ["UCX_NET_DEVICES"])
        except (OSError, ValueError) as e:
            log.warning("UCX's data ports open on every interface (%s): set UCX_NET_DEVICES "
                        "to the interface the bridges use", e)
    elif args.registry:
        log.warning("UCX's data ports open on every interface (no --listen or --peer tells "
                    "which the peers are reached over): set UCX_NET_DEVICES to the interface "
                    "the bridges use")
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
    if args.follow_subscribed_interval is None:
        args.follow_subscribed_interval = _push.FOLLOW_SUBSCRIBED_INTERVAL
    for opt, v in (("--follow-interval", args.follow_interval),
                   ("--follow-subscribed-interval", args.follow_subscribed_interval)):
        if not v > 0:
            log.error("%s %s: must be > 0", opt, v)
            return 2
    for opt, v in (("--replicas-per-uid", args.replicas_per_uid),
                   ("--replica-bytes-per-uid", args.replica_bytes_per_uid),
                   ("--staging-max", args.staging_max)):
        if v is not None and v < 1:
            log.error("%s %s: must be >= 1", opt, v)
            return 2
    if not args.lease_ttl > 0:
        log.error("--lease-ttl %s: must be > 0", args.lease_ttl)
        return 2
    if args.registry_ttl is not None and args.registry_ttl < 2:
        log.error("--registry-ttl %s: must be >= 2", args.registry_ttl)
        return 2
    from ._registry import valid_name
    if args.name is not None and not valid_name(args.name):
        log.error("--name %r: must be 1 to 255 bytes, without ':' or '/', not '*'", args.name)
        return 2
    for opt, v in (("--registry-names", args.registry_names or None), ("--name", args.name),
                   ("--advertise", args.advertise)):
        if v is not None and args.registry and not args.listen:
            log.error("%s needs --listen (a bridge that exports)", opt)
            return 2
    for opt, v in (("--registry-prefix", args.registry_prefix),
                   ("--registry-auth-file", args.registry_auth_file),
                   ("--name", args.name), ("--advertise", args.advertise),
                   ("--registry-ttl", args.registry_ttl),
                   ("--registry-names", args.registry_names or None)):
        if v is not None and not args.registry:
            log.error("%s needs --registry", opt)
            return 2
    token = None
    if args.listen or args.peer or args.registry:
        if not args.token_file:
            log.error("--listen, --peer and --registry need --token-file")
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
    log.info("agent %s; listening on %s; peers %s; exporting %s; local socket %s%s",
             bridge.agent_name, args.listen or "nothing", ", ".join(args.peer or []) or "none",
             ", ".join(args.export or []) or "nothing", path,
             f"; registry {args.registry} as {bridge.name!r}" if args.registry else "")
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
