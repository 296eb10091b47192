"""Tenants from credentials: API keys and client certificates to tenant ids.

A tenant's cache namespace is chosen by the server, never by the request: the tenant id
resolved here goes into `cache_store.hashing.Namespace.tenant`, and the request's
``cache_salt`` only splits that tenant's space further. The router resolves the tenant at
the edge and forwards it to the worker in the cluster-internal ``GenerateRequest.tenant``
field, which workers accept only from peers (`kvmesh.workers.tls`).

API key file (``--api-keys PATH``), one key per line, ``#`` at the start of a line or
after a space starts a comment (a ``#`` inside a key is part of it)::

    # tenant   key (sha256:HEX of the key, or the key itself)   options
    acme       sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8   shared
    beta       beta-key-3f9c1a

Tenant ids are ``[A-Za-z0-9._-]{1,64}``; several keys may map to one tenant (rotation: add
the new key, move clients, delete the old line, restart or SIGHUP-free restart of the
process), but one key (or certificate name) on two lines is an error naming both lines,
as either line winning would silently move that key's clients to another tenant. Keys are kept only as SHA-256 digests and compared in constant time with every
entry. The option ``shared`` lets that tenant read and write the shared namespace: a
request whose ``cache_salt`` is ``shared:NAME`` is cached under the tenant `SHARED_TENANT`
with salt ``NAME``, the same for every tenant holding the option (e.g. a public system
prompt). Any other tenant sending ``shared:...`` gets PERMISSION_DENIED.

A client certificate issued by the client CA (``--client-ca``) stands for a tenant when the
file maps its subject common name with a ``cert:`` line (``acme  cert:acme-gateway``); it is
used when the request carries no API key. In open mode (no file) a certificate's tenant is
``cert:<common name>``.

Public API (also for an HTTP front): ``Authenticator.from_file(path)`` or
``Authenticator.open()``; ``tenant_for(authorization_header, peer_identity=None) -> str``;
``scope(tenant, cache_salt) -> (tenant, cache_salt)``; errors `Unauthenticated`
(gRPC UNAUTHENTICATED, HTTP 401) and `Forbidden` (PERMISSION_DENIED, HTTP 403).
"""
from __future__ import annotations

import hashlib
import hmac
import re
from typing import NamedTuple

import grpc

from kvmesh.workers.tls import Caller, TlsConfig, caller_of
from kvmesh.workers.wire import forwarded_identity

__all__ = ["Unauthenticated", "Forbidden", "Authenticator", "Gate", "SHARED_TENANT", "SHARED_SALT_PREFIX",
           "hash_key", "DEFAULT_TENANT"]

#: Tenant of callers when no API key file is configured (the open, single-tenant mode).
DEFAULT_TENANT = ""
#: Tenant id of the shared namespace (cannot collide with file tenant ids or ``cert:`` ones).
SHARED_TENANT = "*shared*"
#: ``cache_salt`` prefix that selects the shared namespace.
SHARED_SALT_PREFIX = "shared:"

_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: Where a comment starts in an ``--api-keys`` line: a "#" at its start or after whitespace.
_COMMENT_RE = re.compile(r"(?:^|(?<=\s))#")


class Unauthenticated(Exception):
    """No or unknown credentials (gRPC UNAUTHENTICATED, HTTP 401)."""


class Forbidden(Exception):
    """Known caller, action not allowed to it (gRPC PERMISSION_DENIED, HTTP 403)."""


def hash_key(key: str) -> str:
    """``sha256:HEX`` of an API key, the form the key file stores."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class _Entry(NamedTuple):
    digest: bytes          # sha256 of the key, or of b"cert:" + common name
    tenant: str
    shared: bool


def _cert_digest(common_name: str) -> bytes:
    return hashlib.sha256(b"cert:" + common_name.encode()).digest()


class Authenticator:
    """Resolves a request's tenant id from its credentials.

    Args:
        entries: ``[(sha256 digest (32 bytes), tenant id, may use the shared namespace)]``;
            None = open mode: requests without credentials get `DEFAULT_TENANT`.
    """

    def __init__(self, entries: list[tuple[bytes, str, bool]] | None = None):
        self.entries = None if entries is None else [_Entry(*e) for e in entries]
        self._shared = {e.tenant for e in self.entries or () if e.shared}

    @classmethod
    def open(cls) -> "Authenticator":
        """No API keys: every request without credentials is tenant `DEFAULT_TENANT`."""
        return cls(None)

    @classmethod
    def from_file(cls, path: str | None) -> "Authenticator":
        """Parse an ``--api-keys`` file (format in the module docstring); None or "" = `open`.

        Raises:
            ValueError: unreadable file, a line that is not ``TENANT KEY [shared]``
                (KEY: the key, ``sha256:HEX`` of it, or ``cert:COMMON_NAME``), or a key
                given on two lines (as itself or as its digest) (the message names the
                line or both lines; keys are never echoed).
        """
        if not path:
            return cls.open()
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-keys {path}: cannot read it ({exc.strerror})") from None
        entries = []
        seen: dict[bytes, int] = {}  # digest -> the line that gave it
        for no, line in enumerate(lines, 1):
            # a comment starts at a "#" that begins the line or follows a space, so that
            # a key with "#" in it is read whole, not cut to what precedes the "#"
            parts = _COMMENT_RE.split(line, 1)[0].split()
            if not parts:
                continue
            where = f"--api-keys {path} line {no}"
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "shared"):
                raise ValueError(f"{where}: expected `TENANT KEY|sha256:HEX|cert:NAME [shared]`")
            tenant, key = parts[0], parts[1]
            if not _TENANT_RE.fullmatch(tenant):
                raise ValueError(f"{where}: tenant id {tenant!r} must match [A-Za-z0-9._-]{{1,64}}")
            if key.startswith("cert:"):
                if len(key) == 5:
                    raise ValueError(f"{where}: cert: must be followed by a certificate common name")
                digest = _cert_digest(key[5:])
            elif key.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(key[7:])
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise ValueError(f"{where}: sha256: must be followed by 64 hex digits")
            else:
                if len(key) < 16:
                    raise ValueError(f"{where}: a key must be at least 16 characters")
                digest = hashlib.sha256(key.encode()).digest()
            if digest in seen:  # else the later line would silently win
                what = "certificate name" if key.startswith("cert:") else "key"
                raise ValueError(f"--api-keys {path} lines {seen[digest]} and {no}: the same {what} is given twice; "
                                 f"each {what} may stand for one tenant only: delete one of the lines")
            seen[digest] = no
            entries.append((digest, tenant, len(parts) == 3))
        if not entries:
            raise ValueError(f"--api-keys {path}: no keys in the file")
        return cls(entries)

    @property
    def requires_key(self) -> bool:
        return self.entries is not None

    def tenant_for(self, authorization_header: str | None, peer_identity: str | None = None) -> str:
        """The tenant id of a request.

        Args:
            authorization_header: the ``authorization`` header / gRPC metadata value,
                ``Bearer KEY``; None when absent.
            peer_identity: common name of a verified client certificate (client CA), if any.

        Returns:
            the tenant id: the key's tenant; else the tenant the file maps the certificate
            to (``cert:<peer_identity>`` in open mode); else `DEFAULT_TENANT` in open mode,
            where an API key is ignored (OpenAI client libraries always send one).

        Raises:
            Unauthenticated: a malformed or unknown key, an unmapped certificate, or no
                credentials while API keys are configured.
        """
        if authorization_header and self.entries is None:
            # open mode: a key means nothing here, as in an OpenAI-compatible server started
            # without keys (client libraries always send one); the caller is anonymous
            authorization_header = None
        if authorization_header:
            scheme, _, key = authorization_header.strip().partition(" ")
            key = key.strip()
            if scheme.lower() != "bearer" or not key:
                raise Unauthenticated("authorization must be `Bearer KEY` (set --api-key or KVMESH_API_KEY)")
            found = self._lookup(hashlib.sha256(key.encode()).digest())
            if found is None:
                raise Unauthenticated("unknown API key (check --api-key or KVMESH_API_KEY)")
            return found
        if peer_identity:
            if self.entries is None:
                return "cert:" + peer_identity
            found = self._lookup(_cert_digest(peer_identity))
            if found is None:
                raise Unauthenticated(f"client certificate {peer_identity!r} is not mapped to a tenant in --api-keys "
                                      "and no API key was sent")
            return found
        if self.entries is not None:
            raise Unauthenticated("no credentials: send `authorization: Bearer KEY` metadata "
                                  "(kvmesh clients: --api-key or KVMESH_API_KEY)")
        return DEFAULT_TENANT

    def _lookup(self, digest: bytes) -> str | None:
        found = None
        for e in self.entries or ():  # every entry, no early exit: time does not depend on which matched
            if hmac.compare_digest(e.digest, digest):
                found = e.tenant
        return found

    def scope(self, tenant: str, cache_salt: str) -> tuple[str, str]:
        """The (tenant, cache salt) a request's blocks are cached under.

        Raises:
            Forbidden: ``cache_salt`` asks for the shared namespace and ``tenant`` lacks
                the ``shared`` option (in open mode the salt is kept as is).
        """
        if self.entries is None or not cache_salt.startswith(SHARED_SALT_PREFIX):
            return tenant, cache_salt
        if tenant not in self._shared:
            raise Forbidden(f"tenant {tenant!r} may not use the shared namespace (cache_salt "
                            f"{SHARED_SALT_PREFIX}...): add the `shared` option to its --api-keys line")
        return SHARED_TENANT, cache_salt[len(SHARED_SALT_PREFIX):]


def _metadata(context, name: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == name:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


class Gate:
    """Per-RPC access checks of one gRPC port (worker or router).

    Args:
        tls: the port's TLS config; None = no TLS, every caller is a peer.
        auth: tenant resolution; None = `Authenticator.open`.
    """

    def __init__(self, tls: TlsConfig | None = None, auth: Authenticator | None = None):
        self.tls = tls
        self.auth = auth or Authenticator.open()

    def caller(self, context) -> Caller:
        return caller_of(context, self.tls)

    async def require_peer(self, context, what: str) -> None:
        """Abort with PERMISSION_DENIED unless the caller is a cluster peer."""
        if not self.caller(context).is_peer:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{what} is cluster-internal: only peers holding a certificate of the cluster CA "
                                "(--tls-ca) may call it")

    async def require_caller(self, context, what: str | None) -> None:
        """Abort with UNAUTHENTICATED unless the caller is a cluster peer or has credentials
        that map to a tenant (the same ones a Generate needs; anyone in open mode). The
        message names ``what`` (None: the refusal alone, as `identity` gives it)."""
        caller = self.caller(context)
        if caller.is_peer:
            return
        try:
            self.auth.tenant_for(_metadata(context, "authorization"), caller.name if caller.kind == "client" else None)
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what}: {exc}" if what else str(exc))

    async def admit(self, context) -> None:
        """Abort with UNAUTHENTICATED, at a data-plane call's start (before its request message
        arrives: `kvmesh.workers.grpc_guard.CallAdmission`), unless the caller is a peer or
        has credentials that map to a tenant; the same refusal `identity` gives later."""
        await self.require_caller(context, None)

    async def tenant(self, context, request, edge: bool = False) -> tuple[str, str]:
        """(tenant, cache salt) of a Generate request; aborts the RPC on a refusal.
        See `identity`."""
        _, tenant, salt = await self.identity(context, request, edge)
        return tenant, salt

    async def identity(self, context, request, edge: bool = False) -> tuple[str, str, str]:
        """(caller's tenant, cache tenant, cache salt) of a Generate request; aborts the RPC
        on a refusal.

        The cache tenant and salt are the namespace the request's blocks are cached under
        (`Authenticator.scope`: a ``shared:`` salt moves them to the shared namespace); the
        caller's tenant is the one its credentials name, which per-tenant limits count
        against, so that shared-namespace requests are not one bucket for every tenant.
        A peer's request carries what the router resolved (``request.tenant``,
        ``request.caller_tenant``), trusted as is, unless ``edge`` (the router: clients
        only). Anyone else is resolved from credentials, and may not set ``tenant``,
        ``caller_tenant`` or ``prefix_location``.
        """
        caller = self.caller(context)
        if caller.is_peer and not edge:
            return forwarded_identity(request)
        for field in ("tenant", "caller_tenant", "prefix_location"):
            if request.HasField(field) if field == "prefix_location" else getattr(request, field):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"GenerateRequest.{field} is cluster-internal (set by the router); leave it "
                                    "unset")
        try:
            tenant = self.auth.tenant_for(_metadata(context, "authorization"),
                                          caller.name if caller.kind == "client" else None)
            return (tenant, *self.auth.scope(tenant, request.cache_salt))
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except Forbidden as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
