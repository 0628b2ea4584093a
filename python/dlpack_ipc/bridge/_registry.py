# SPDX-License-Identifier: Apache-2.0
"""Finding peer bridges through etcd (--registry; docs/bridge.md, "A registry of bridges").

An exporting bridge keeps one record of itself, under <prefix>hosts/<its --name>, on a lease it
owns and renews: the address its peers connect to, its NIXL agent and its export prefixes. With
--registry-names it also keeps a key per exported name it holds, <prefix>names/<the name in
base64url>/<its --name>, on the same lease. Both go when the bridge stops (the lease is revoked)
or REGISTRY_TTL after it died. An importing bridge asked for NAME:name with no --peer NAME reads
NAME's record and connects there, authenticated by the shared token as any peer; asked for
*:name, it reads which bridges hold name and fetches from the first that serves it. etcd is
spoken to through its JSON gateway (POST /v3/...), with nothing but the standard library.
"""
import base64
import errno
import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

# Seconds a record outlives a bridge that died without revoking it (its lease's TTL); the
# bridge renews the lease every third of it. --registry-ttl sets it.
REGISTRY_TTL = 10
# Seconds each step of one request to etcd (connect, send, each read) may take.
REQUEST_TIMEOUT = 5.0
# Seconds a stopping bridge waits for its registry thread to revoke its lease (a request under
# way, with credentials, may take four steps first); past it the record ends with its TTL.
STOP_WAIT = 6 * REQUEST_TIMEOUT
# Bytes of one answer from etcd read at most, and of one record; what is larger is refused.
ANSWER_MAX = 64 << 10
RECORD_MAX = 4096
# Peers an importing bridge keeps a link to that it found in the registry (a link is a
# control connection and the peer's NIXL agent once used); a fetch from one more is refused
# with EAGAIN.
FOUND_PEERS_MAX = 256
# A peer looked up in the registry this many seconds ago or less is not looked up again before
# connecting to it (the first connection follows the lookup that found it).
LOOKUP_FRESH = 1.0
# The registry's keys start with this; --registry-prefix sets it.
REGISTRY_PREFIX = "/dlpackd-bridge/"
# Exported names one bridge writes in the registry with --registry-names, at most; past it the
# others are fetched by the host's name only (logged once).
NAMES_MAX = 4096
# Keys written or deleted by one request (etcd's default --max-txn-ops).
TXN_OPS_MAX = 128
# Seconds the names changed in a burst are gathered before their keys are written.
NAMES_COALESCE = 0.1
# Bridges a fetch of *:name reads from the registry, and tries, at most.
HOLDERS_MAX = 64
HOLDERS_TRIED_MAX = 4
# The peer part of a fetch that asks the registry which bridge holds the name.
ANY_HOST = "*"

log = logging.getLogger("dlpackd-bridge")


def _b64(data):
    return base64.b64encode(data).decode()


def read_auth(path):
    """USER:PASSWORD from the first line of path, refused if group or others may read it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise PermissionError(f"registry credentials {path} are accessible by group or "
                                  "others: chmod 600 it")
        line = f.readline(4096).decode(errors="replace").strip()
    user, sep, password = line.partition(":")
    if not sep or not user:
        raise ValueError(f"registry credentials {path}: the first line is not USER:PASSWORD")
    return user, password


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """etcd does not redirect: one that does is refused (its Authorization header would go
    with it)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# no proxy from the environment, no redirect
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


# What etcd says when it refuses a request's credentials (as an invalid argument, code 3).
_AUTH_ERRORS = ("etcdserver: user name is empty", "etcdserver: invalid auth token",
                "etcdserver: authentication failed", "etcdserver: permission denied",
                "etcdserver: revision of auth store is old")


def _refused(url, status, code, msg):
    """Raise what etcd's error answer means: PermissionError for gRPC's UNAUTHENTICATED and
    PERMISSION_DENIED (and a request without a token, or with one etcd no longer takes, which
    it answers as an invalid argument naming it), else OSError EPROTO."""
    msg = str(msg)[:300]
    if status in (401, 403) or code in (7, 16) or any(w in msg for w in _AUTH_ERRORS):
        raise PermissionError(errno.EACCES, f"registry {url}: {msg}") from None
    raise OSError(errno.EPROTO, f"registry {url}: HTTP {status}: {msg}") from None


class Etcd:
    """The few calls of etcd's v3 JSON gateway the bridge makes. Each raises OSError naming the
    registry: ConnectionError when etcd cannot be reached, PermissionError when it refuses the
    credentials, OSError EPROTO for an answer that is not what etcd sends."""

    def __init__(self, url, auth=None, timeout=REQUEST_TIMEOUT):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise ValueError(f"--registry {url!r} is not http://HOST:PORT or https://HOST:PORT")
        self.url = url.rstrip("/")
        self.auth = auth
        self._token = None
        self._lock = threading.Lock()
        self.timeout = timeout

    def _post(self, path, body, token, timeout=None):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        if token:
            req.add_header("Authorization", token)
        try:
            with _OPENER.open(req, timeout=timeout or self.timeout) as r:
                data = r.read(ANSWER_MAX + 1)
        except urllib.error.HTTPError as e:
            try:
                data = e.read(ANSWER_MAX + 1)
                why = json.loads(data)
                code, msg = why.get("code"), why.get("error") or why.get("message")
            except (ValueError, AttributeError, RecursionError, OSError,
                    http.client.HTTPException):
                code, msg = None, f"HTTP {e.code} {e.reason}"
            _refused(self.url, e.code, code, msg)
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            raise ConnectionError(errno.ECONNREFUSED, f"registry {self.url} cannot be "
                                  f"reached: {why}") from None
        except (http.client.HTTPException, ValueError) as e:
            raise OSError(errno.EPROTO, f"registry {self.url}: not an HTTP answer to {path}: "
                          f"{e!r}"[:300]) from None
        if len(data) > ANSWER_MAX:
            raise OSError(errno.EPROTO, f"registry {self.url}: an answer over ANSWER_MAX "
                          f"({ANSWER_MAX} bytes)")
        try:
            out = json.loads(data)
        except (ValueError, RecursionError):
            out = None
        if not isinstance(out, dict):
            raise OSError(errno.EPROTO, f"registry {self.url}: its answer to {path} is not "
                          "a JSON object (is this etcd's gateway?)")
        err = out.get("error")
        if err is not None:         # what the gateway's streaming calls answer with a 200
            if isinstance(err, dict):
                _refused(self.url, 200, err.get("grpc_code"), err.get("message", err))
            _refused(self.url, 200, None, err)
        return out

    def call(self, path, body, timeout=None):
        """POST body to path; with credentials, authenticated first, and once more when
        etcd no longer takes the token (it expires). timeout: each step's, in place of the
        client's."""
        with self._lock:
            token = self._token
        if self.auth and token is None:
            token = self._authenticate(timeout)
        try:
            return self._post(path, body, token, timeout)
        except PermissionError:
            if not self.auth:
                raise
        return self._post(path, body, self._authenticate(timeout), timeout)

    def _authenticate(self, timeout=None):
        user, password = self.auth
        out = self._post("/v3/auth/authenticate", {"name": user, "password": password}, None,
                         timeout)
        token = out.get("token")
        if not isinstance(token, str) or not token:
            raise PermissionError(errno.EACCES, f"registry {self.url}: no token for {user!r}")
        with self._lock:
            self._token = token
        return token

    def grant(self, ttl):
        lease = self.call("/v3/lease/grant", {"TTL": ttl}).get("ID")
        if not isinstance(lease, str) or not lease.isdigit():
            raise OSError(errno.EPROTO, f"registry {self.url}: no lease in its answer")
        return lease

    def keepalive(self, lease):
        """The lease's TTL left after renewing it; 0 when etcd says it is gone."""
        out = self.call("/v3/lease/keepalive", {"ID": lease}).get("result")
        if not isinstance(out, dict):
            raise OSError(errno.EPROTO, f"registry {self.url}: no result renewing lease {lease}")
        ttl = out.get("TTL", "0")       # absent: the lease is gone
        return int(ttl) if isinstance(ttl, str) and ttl.isascii() and ttl.isdigit() else 0

    def revoke(self, lease):
        self.call("/v3/lease/revoke", {"ID": lease})

    def create(self, key, value, lease):
        """Put key on lease only where it does not exist; (value, lease) of the key that is
        there instead, or None."""
        k = _b64(key.encode())
        out = self.call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease}}],
            "failure": [{"request_range": {"key": k}}]})
        if out.get("succeeded"):
            return None
        try:
            for r in out.get("responses") or []:
                kvs = (r.get("response_range") or {}).get("kvs") or []
                if kvs:
                    return (base64.b64decode(kvs[0].get("value", ""), validate=True),
                            str(kvs[0].get("lease", "0")))
        except (AttributeError, TypeError, ValueError, KeyError):
            raise OSError(errno.EPROTO, f"registry {self.url}: a malformed answer about "
                          f"{key}") from None
        return b"", "0"

    def move(self, key, value, lease):
        """Put key on lease where it holds value; whether it did."""
        k = _b64(key.encode())
        out = self.call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(value)}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease}}]})
        return bool(out.get("succeeded"))

    def keys(self, prefix, limit):
        """The keys that start with prefix, at most limit of them, sorted."""
        p = prefix.encode()
        out = self.call("/v3/kv/range", {"key": _b64(p), "range_end": _b64(_after(p)),
                                         "keys_only": True, "limit": limit})
        try:
            kvs = out.get("kvs") or []
            return [base64.b64decode(kv["key"], validate=True).decode() for kv in kvs[:limit]]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise OSError(errno.EPROTO, f"registry {self.url}: a malformed answer about the "
                          f"keys under {prefix}") from None

    def get(self, key, timeout=None):
        """The value of key, or None."""
        kvs = self.call("/v3/kv/range", {"key": _b64(key.encode())}, timeout).get("kvs") or []
        try:
            if not kvs:
                return None
            return base64.b64decode(kvs[0].get("value", ""), validate=True)
        except (AttributeError, TypeError, ValueError, KeyError):
            raise OSError(errno.EPROTO, f"registry {self.url}: a malformed answer about "
                          f"{key}") from None


def _after(prefix):
    """The first key past every key that starts with prefix (etcd's range_end)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    p[-1] += 1
    return bytes(p)


def record_key(prefix, name):
    return f"{prefix}hosts/{name}"


def holders_prefix(prefix, name):
    """Where the bridges that hold the exported name write their keys (name in base64url:
    a name may hold '/', and no name's keys may start another's)."""
    return f"{prefix}names/{base64.urlsafe_b64encode(name.encode()).decode()}/"


def valid_name(name):
    """Whether name can be a bridge's name (--name): 1 to 255 bytes, no ':' or '/', not
    ANY_HOST."""
    return isinstance(name, str) and 0 < len(name.encode()) <= 255 and ":" not in name and \
        "/" not in name and name != ANY_HOST


def holders(etcd, prefix, name):
    """The names of the bridges (at most HOLDERS_MAX) that hold name, sorted; keys that do
    not end in a bridge's name are passed over."""
    under = holders_prefix(prefix, name)
    return [k[len(under):] for k in etcd.keys(under, HOLDERS_MAX)
            if k.startswith(under) and valid_name(k[len(under):])]


class Registration:
    """The exporting bridge's record and, with names (a callable telling whether a name is
    exported), the keys of the exported names it holds: kept by its own thread (run()) until
    stop is set, then revoked. A record of the same name that another bridge holds is left
    alone: this one is written once that one's lease has ended."""

    def __init__(self, etcd, prefix, name, record, ttl, stop, names=None):
        self.etcd, self.key, self.ttl, self.stop = etcd, record_key(prefix, name), ttl, stop
        self.prefix, self.name, self.exported = prefix, name, names
        self.value = json.dumps(record, sort_keys=True).encode()
        if len(self.value) > RECORD_MAX:
            raise ValueError(f"the registry record of {name!r} is over RECORD_MAX "
                             f"({RECORD_MAX} bytes): fewer or shorter --export")
        self.lease = None
        self.registered = False
        self._why = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._names = set()         # the exported names held here (at most NAMES_MAX)
        self._written = set()       # those whose key is written on the lease now
        self._over = False          # NAMES_MAX was reached (logged once)
        self._renewed = 0.0         # when the lease was last renewed (monotonic)

    def names(self):
        """The exported names whose key is in the registry now."""
        with self._lock:
            return set(self._written) if self.registered else set()

    def _problem(self, why):
        if why != self._why:
            log.warning("registry: %s", why)
        self._why = why

    def set_names(self, names):
        """The exported names held here are these (all of them, after a watch was opened)."""
        with self._lock:
            self._names = set()
            for n in names:
                self._add(n)
        self._wake.set()

    def name_changed(self, name, present):
        with self._lock:
            if present:
                self._add(name)
            else:
                self._names.discard(name)
        self._wake.set()

    def _add(self, name):
        """Under self._lock."""
        if len(self._names) < NAMES_MAX:
            self._names.add(name)
        elif name not in self._names and not self._over:
            self._over = True
            log.warning("registry: more than NAMES_MAX (%d) exported names: the others are "
                        "not written (peers fetch them as %s:name)", NAMES_MAX, self.name)

    def _sync_names(self):
        """Write the keys of the names held here that are not written, delete those of the
        names that went: TXN_OPS_MAX to a request, the lease renewed between requests when
        due (thousands of names take several); given up at stop."""
        with self._lock:
            add, gone = sorted(self._names - self._written), sorted(self._written - self._names)
        value = _b64(json.dumps({"host": self.name}).encode())
        ops = [(n, {"request_put": {"key": _b64(self._name_key(n).encode()), "value": value,
                                    "lease": self.lease}}) for n in add]
        ops += [(n, {"request_delete_range": {"key": _b64(self._name_key(n).encode())}})
                for n in gone]
        for i in range(0, len(ops), TXN_OPS_MAX):
            if self.stop.is_set():
                return
            self._renew_if_due()
            batch = ops[i:i + TXN_OPS_MAX]
            self.etcd.call("/v3/kv/txn", {"success": [op for _, op in batch]})
            with self._lock:
                for n, op in batch:
                    if "request_put" in op:
                        self._written.add(n)
                    else:
                        self._written.discard(n)

    def _renew_if_due(self):
        """Renew the lease if a third of its TTL went by since it was last renewed."""
        if time.monotonic() - self._renewed < self.ttl / 3:
            return
        t0 = time.monotonic()       # renewed as of the request, not of its answer
        if self.etcd.keepalive(self.lease) <= 0:
            raise FileNotFoundError(errno.ENOENT, f"the lease of {self.key} ended")
        self._renewed = t0

    def _name_key(self, name):
        return holders_prefix(self.prefix, name) + self.name

    def _step(self):
        """Renew the lease and see that the record is there on it (written where it is not),
        and the names' keys; the seconds to wait before the next step."""
        if self.lease is not None:
            try:
                self._renewed = 0.0
                self._renew_if_due()
            except FileNotFoundError:
                self._problem(f"the lease of {self.key} ended (etcd lost it, or this bridge "
                              "was cut off for longer than its TTL): writing the record again")
                self.lease, self.registered = None, False
        if self.lease is None:
            t0 = time.monotonic()
            self.lease = self.etcd.grant(self.ttl)
            self._renewed = t0
            with self._lock:
                self._written = set()       # the keys went with the lease before
        held = self.etcd.create(self.key, self.value, self.lease)
        if held is None and self.registered:
            # the record was deleted under a live lease (by hand): the names' keys with it
            with self._lock:
                self._written = set()
        if held is not None and held[0] != self.value:
            self._problem(f"{self.key} is held by another bridge ({held[0][:200]!r}): "
                          "written once its lease ends")
            self.registered = False
            return 1.0
        if held is not None and held[1] != self.lease:
            # this bridge's record on a lease it no longer renews (one it took for lost):
            # moved onto this one, or it would go when that one ends
            if not self.etcd.move(self.key, self.value, self.lease):
                self.registered = False
                return 1.0
            with self._lock:
                self._written = set()
        if not self.registered:
            log.info("registry: %s written at %s (lease %s, TTL %d s)", self.key,
                     self.etcd.url, self.lease, self.ttl)
        self.registered = True
        if self.exported is not None:
            self._sync_names()
        self._why = None
        return self.ttl / 3

    def run(self):
        due = 0.0
        while not self.stop.is_set():
            # woken early by a name that changed; stop looked at every quarter second
            woke = self._wake.wait(max(0.0, min(0.25, due - time.monotonic())))
            if woke:
                self._wake.clear()
            try:
                if time.monotonic() >= due:
                    due = time.monotonic() + self._step()
                elif woke and self.registered and self.exported is not None:
                    self.stop.wait(NAMES_COALESCE)  # a burst of changes, written at once
                    self._sync_names()
            except Exception as e:      # the thread lives on whatever etcd answered
                self._problem(getattr(e, "strerror", None) or repr(e))
                self.registered = False
                due = time.monotonic() + min(1.0, self.ttl / 3)
        self.close()

    def watch_names(self, dlpackd_socket, prefix, again=1.0):
        """The thread that tells run() which exported names this host's dlpackd holds: a watch
        of prefix, and the list once it is open (nothing changed meanwhile is missed); opened
        again after again seconds when lost, until stop."""
        import dlpack_ipc
        while not self.stop.is_set():
            w = None
            try:
                w = dlpack_ipc.watch(prefix, socket=dlpackd_socket)
                c = dlpack_ipc.Client(dlpackd_socket)
                try:
                    entries = c.list(prefix)
                finally:
                    c.close()
                self.set_names(e.name for e in entries if self.exported(e.name))
                while not self.stop.is_set():
                    ev = w.next_event(0.5)
                    if ev is not None and ev.kind in ("published", "replaced", "unpublished") \
                            and self.exported(ev.name):
                        self.name_changed(ev.name, ev.kind != "unpublished")
            except Exception as e:      # dlpackd restarted, or anything else: watched anew
                log.info("registry: the watch of this host's dlpackd for exported names: %s",
                         e)
            finally:
                if w is not None:
                    w.close()
            self.stop.wait(again)

    def close(self):
        """Revoke the lease (the record and the names' keys go with it), if one was
        granted."""
        lease, self.lease, self.registered = self.lease, None, False
        with self._lock:
            self._written = set()
        if lease is None:
            return
        try:
            self.etcd.revoke(lease)
            log.info("registry: %s removed", self.key)
        except OSError as e:
            log.warning("registry: %s stays until its lease ends (%d s): %s", self.key,
                        self.ttl, e.strerror or e)


class NotRegistered(ConnectionError):
    """A peer found in the registry before is no longer registered (errno ENOENT): a local
    caller's fetch fails with FileNotFoundError, while a --follow takes the peer as away, not
    its entry as gone, and keeps its replica."""


def lookup(etcd, prefix, name, timeout=None):
    """The (host, port) of the bridge registered as name; FileNotFoundError when none is,
    OSError EPROTO for a record that is not one."""
    from ._server import parse_addr
    key = record_key(prefix, name)
    value = etcd.get(key, timeout)
    if value is None:
        raise FileNotFoundError(errno.ENOENT, f"no peer {name!r} is configured (--peer) or "
                                f"registered ({key} at {etcd.url})")
    try:
        if len(value) > RECORD_MAX:
            raise ValueError(f"over RECORD_MAX ({RECORD_MAX} bytes)")
        rec = json.loads(value)
        if not isinstance(rec, dict) or not isinstance(rec.get("addr"), str):
            raise ValueError("no addr")
        return parse_addr(rec["addr"], "addr")
    except (ValueError, RecursionError) as e:
        raise OSError(errno.EPROTO, f"{key} at {etcd.url} is not a bridge's record: "
                      f"{e!r}"[:400]) from None
