# SPDX-License-Identifier: Apache-2.0
"""Finding peer bridges through etcd (--registry; docs/bridge.md, "A registry of bridges").

An exporting bridge keeps one record of itself, under <prefix>hosts/<its --name>, on a lease it
owns and renews: the address its peers connect to, its NIXL agent and its export prefixes. The
record goes when the bridge stops (the lease is revoked) or REGISTRY_TTL after it died. An
importing bridge asked for NAME:name with no --peer NAME reads NAME's record and connects there,
authenticated by the shared token as any peer. etcd is spoken to through its JSON gateway (POST
/v3/...), with nothing but the standard library.
"""
import base64
import errno
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request

# Seconds a record outlives a bridge that died without revoking it (its lease's TTL); the
# bridge renews the lease every third of it. --registry-ttl sets it.
REGISTRY_TTL = 10
# Seconds one request to etcd may take.
REQUEST_TIMEOUT = 5.0
# Bytes of one answer from etcd read at most, and of one record; what is larger is refused.
ANSWER_MAX = 64 << 10
RECORD_MAX = 4096
# Peers an importing bridge keeps a link to that it found in the registry (a link is a
# control connection and the peer's NIXL agent once used); a fetch from one more is refused
# with EAGAIN.
FOUND_PEERS_MAX = 256
# The registry's keys start with this; --registry-prefix sets it.
REGISTRY_PREFIX = "/dlpackd-bridge/"

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


class Etcd:
    """The few calls of etcd's v3 JSON gateway the bridge makes. Each raises OSError naming the
    registry: ConnectionError when etcd cannot be reached, PermissionError when it refuses the
    credentials, OSError EPROTO for an answer that is not what etcd sends."""

    def __init__(self, url, auth=None, timeout=REQUEST_TIMEOUT):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise ValueError(f"--registry {url!r} is not http://HOST:PORT or https://HOST:PORT")
        self.url = url.rstrip("/")
        self._auth = auth
        self._token = None
        self._lock = threading.Lock()
        self.timeout = timeout

    def _post(self, path, body, token):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        if token:
            req.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                data = r.read(ANSWER_MAX + 1)
        except urllib.error.HTTPError as e:
            data = e.read(ANSWER_MAX + 1)
            try:
                why = json.loads(data)
                code, msg = why.get("code"), why.get("error") or why.get("message")
            except (ValueError, AttributeError):
                code, msg = None, data[:200].decode(errors="replace")
            # gRPC's UNAUTHENTICATED and PERMISSION_DENIED; etcd answers a request without a
            # token, or with one it no longer takes, as an invalid argument naming it
            if e.code in (401, 403) or code in (7, 16) or any(
                    w in str(msg) for w in ("user name is empty", "auth", "permission denied")):
                raise PermissionError(errno.EACCES, f"registry {self.url}: {msg}") from None
            raise OSError(errno.EPROTO, f"registry {self.url}: HTTP {e.code}: {msg}") from None
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            raise ConnectionError(errno.ECONNREFUSED, f"registry {self.url} cannot be "
                                  f"reached: {why}") from None
        if len(data) > ANSWER_MAX:
            raise OSError(errno.EPROTO, f"registry {self.url}: an answer over ANSWER_MAX "
                          f"({ANSWER_MAX} bytes)")
        try:
            out = json.loads(data)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise OSError(errno.EPROTO, f"registry {self.url}: its answer to {path} is not "
                          "a JSON object (is this etcd's gateway?)")
        return out

    def call(self, path, body):
        """POST body to path; with credentials, authenticated first, and once more when
        etcd no longer takes the token (it expires)."""
        with self._lock:
            token = self._token
        if self._auth and token is None:
            token = self._authenticate()
        try:
            return self._post(path, body, token)
        except PermissionError:
            if not self._auth:
                raise
        return self._post(path, body, self._authenticate())

    def _authenticate(self):
        user, password = self._auth
        out = self._post("/v3/auth/authenticate", {"name": user, "password": password}, None)
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
        """The lease's TTL left after renewing it; 0 when it is gone."""
        out = self.call("/v3/lease/keepalive", {"ID": lease}).get("result")
        ttl = out.get("TTL", "0") if isinstance(out, dict) else "0"
        return int(ttl) if isinstance(ttl, str) and ttl.isdigit() else 0

    def revoke(self, lease):
        self.call("/v3/lease/revoke", {"ID": lease})

    def create(self, key, value, lease):
        """Put key only where it does not exist; the value it holds instead, or None."""
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
                    return base64.b64decode(kvs[0].get("value", ""), validate=True)
        except (AttributeError, TypeError, ValueError):
            raise OSError(errno.EPROTO, f"registry {self.url}: a malformed answer about "
                          f"{key}") from None
        return b""

    def get(self, key):
        """The value of key, or None."""
        kvs = self.call("/v3/kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        if not kvs or not isinstance(kvs[0], dict):
            return None
        try:
            return base64.b64decode(kvs[0].get("value", ""), validate=True)
        except (ValueError, TypeError):
            raise OSError(errno.EPROTO, f"registry {self.url}: {key} is not base64") from None


def record_key(prefix, name):
    return f"{prefix}hosts/{name}"


class Registration:
    """The exporting bridge's record, kept by its own thread (run()) until stop is set, then
    revoked. A record of the same name that another bridge holds is left alone: this one is
    written once that one's lease has ended."""

    def __init__(self, etcd, prefix, name, record, ttl, stop):
        self.etcd, self.key, self.ttl, self.stop = etcd, record_key(prefix, name), ttl, stop
        self.value = json.dumps(record, sort_keys=True).encode()
        if len(self.value) > RECORD_MAX:
            raise ValueError(f"the registry record of {name!r} is over RECORD_MAX "
                             f"({RECORD_MAX} bytes): fewer or shorter --export")
        self.lease = None
        self.registered = False
        self._why = None

    def _problem(self, why):
        if why != self._why:
            log.warning("registry: %s", why)
        self._why = why

    def _step(self):
        """Renew the lease and see that the record is there (written where it is not); the
        seconds to wait before the next step."""
        if self.lease is not None and self.etcd.keepalive(self.lease) <= 0:
            self._problem(f"the lease of {self.key} ended (etcd lost it, or this bridge was "
                          "cut off for longer than its TTL): writing the record again")
            self.lease, self.registered = None, False
        if self.lease is None:
            self.lease = self.etcd.grant(self.ttl)
        held = self.etcd.create(self.key, self.value, self.lease)
        if held is not None and held != self.value:
            self._problem(f"{self.key} is held by another bridge ({held[:200]!r}): written "
                          "once its lease ends")
            self.registered = False
            return 1.0
        if not self.registered:
            log.info("registry: %s written at %s (lease %s, TTL %d s)", self.key,
                     self.etcd.url, self.lease, self.ttl)
        self.registered = True
        self._why = None
        return self.ttl / 3

    def run(self):
        wait = 0.0
        while not self.stop.wait(wait):
            try:
                wait = self._step()
            except Exception as e:      # the thread lives on whatever etcd answered
                self._problem(getattr(e, "strerror", None) or repr(e))
                self.registered = False
                wait = min(1.0, self.ttl / 3)
        self.close()

    def close(self):
        """Revoke the lease (the record goes with it), if one was granted."""
        lease, self.lease, self.registered = self.lease, None, False
        if lease is None:
            return
        try:
            self.etcd.revoke(lease)
            log.info("registry: %s removed", self.key)
        except OSError as e:
            log.warning("registry: %s stays until its lease ends (%d s): %s", self.key,
                        self.ttl, e.strerror or e)


def lookup(etcd, prefix, name):
    """The (host, port) of the bridge registered as name; FileNotFoundError when none is,
    OSError EPROTO for a record that is not one."""
    from ._server import parse_addr
    key = record_key(prefix, name)
    value = etcd.get(key)
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
    except ValueError as e:
        raise OSError(errno.EPROTO, f"{key} at {etcd.url} is not a bridge's record: "
                      f"{e}") from None
