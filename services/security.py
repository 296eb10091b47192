"""Security flags of the `kvmesh` CLI, and secure channels for clients.

Servers (``worker``, ``router``): ``--tls-cert``, ``--tls-key``, ``--tls-ca``,
``--client-ca``, ``--api-keys``, ``--insecure``, ``--reflection``; `server_gate` builds the
port's `kvmesh.services.auth.Gate` from them and refuses a non-loopback bind without TLS
unless ``--insecure``. Clients (``generate``, ``bench --target``): ``--tls-ca`` (env
``KVMESH_TLS_CA``), ``--api-key`` (env ``KVMESH_API_KEY``), and optionally
``--tls-cert``/``--tls-key`` for a client certificate; `client_channel` opens the channel.
The API key travels as ``authorization: Bearer KEY`` call credentials, which gRPC sends
only over TLS, so a key without ``--tls-ca`` is refused rather than sent in clear.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import re
from urllib.parse import parse_qs, urlparse

import grpc

from kvmesh.services.auth import Authenticator, Gate
from kvmesh.workers.tls import TlsConfig

log = logging.getLogger(__name__)

__all__ = ["add_server_args", "add_client_args", "server_gate", "client_channel", "client_options",
           "redact_url", "is_loopback"]

_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^@\s]+)(?=@)", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``
    (``redis://:s3cret@host:6379/0`` -> ``redis://:***@host:6379/0``)."""
    return _URL_PASSWORD.sub(lambda m: m.group("head") + "***", str(text))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the port to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The security flags of a gRPC server process (worker, router)."""
    g = p.add_argument_group("security (docs/SECURITY.md)")
    g.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="this process's certificate (PEM), served on its port and presented to peers (mTLS)")
    g.add_argument("--tls-key", default=None, metavar="PATH", help="private key of --tls-cert (PEM)")
    g.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="cluster CA (PEM): every certificate it signs is a cluster peer")
    g.add_argument("--client-ca", default=None, metavar="PATH",
                   help="CA of client certificates (tenant cert:<common name>); must not be the cluster CA")
    g.add_argument("--api-keys", default=None, metavar="PATH",
                   help="file of `TENANT KEY|sha256:HEX [shared]` lines; clients then need an API key")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without TLS (anyone reaching the port is trusted)")
    g.add_argument("--reflection", action="store_true", help="serve gRPC reflection (off by default)")


def server_gate(args: argparse.Namespace, worker: bool = False) -> Gate:
    """The `Gate` of a server from its parsed flags; a ``worker`` port requires client
    certificates (cluster peers, or clients of ``--client-ca``).

    Raises:
        ValueError: unreadable or inconsistent TLS / API key files, ``--api-keys`` without
            TLS, a non-loopback ``--host`` without TLS and without ``--insecure``, or an
            ``--http-port`` without ``--api-keys`` on a port that requires client certificates.
    """
    # the vLLM router mode's certificate serves HTTPS only: no cluster peer checks it
    tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.client_ca,
                               peer=getattr(args, "backend", None) != "vllm")
    if tls is not None and worker:
        tls = dataclasses.replace(tls, require_client_cert=True)
    host = getattr(args, "host", "127.0.0.1")
    if tls is None and not is_loopback(host) and not args.insecure:
        raise ValueError(f"--host {host} is reachable from other machines but TLS is off: pass --tls-cert, "
                         "--tls-key and --tls-ca, or --insecure to run without (see docs/SECURITY.md)")
    if tls is None and args.api_keys:
        raise ValueError("--api-keys needs TLS (--tls-cert, --tls-key, --tls-ca): keys would cross the network in clear")
    requires_cert = tls is not None and (tls.require_client_cert if tls.require_client_cert is not None
                                         else bool(tls.client_ca))
    http_front = getattr(args, "http_port", None) not in (None, -1) and getattr(args, "backend", None) != "vllm"
    if requires_cert and http_front and not args.api_keys:
        # the HTTPS front sees no client certificate: without keys it would serve anyone what the
        # gRPC port serves only to certificate holders
        who = "cluster peers" if worker else "clients with a certificate from --client-ca"
        raise ValueError(f"--http-port would open this {'worker' if worker else 'router'} to anyone: its gRPC port "
                         f"admits only {who}, and the HTTP front authenticates with API keys alone; pass "
                         "--api-keys, or leave --http-port out")
    warn_open_redis(tls is not None, getattr(args, "redis_url", None))
    return Gate(tls, Authenticator.from_file(args.api_keys))


def warn_open_redis(tls: bool, redis_url: str | None) -> bool:
    """Log a WARNING (and return True) when a TLS server is given a Redis URL without a password.

    TLS keeps strangers off the gRPC ports; the cluster's Redis holds its leases, KV events
    and remote tier, so a Redis that anyone on the network can write to undoes part of it: a
    stranger could publish false KV events (misrouting, never wrong output) or, without
    ``--remote-record-key-file``, store forged remote-tier records. Unix sockets are left to
    their file permissions.
    """
    if not tls or not redis_url:
        return False
    url = urlparse(redis_url)
    if url.scheme not in ("redis", "rediss") or url.password or "password" in parse_qs(url.query):
        return False
    log.warning("--redis-url has no password while this server uses TLS: whoever reaches that Redis can publish "
                "KV events and write the remote tier; set requirepass on Redis and pass the URL with it "
                "(redis://:PASSWORD@HOST:PORT/0) in KVMESH_REDIS_URL, which keeps it out of ps")
    return True


def add_client_args(p: argparse.ArgumentParser, tls_ca: bool = True) -> None:
    """Credential flags of a client command (defaults from ``KVMESH_*`` env vars)."""
    g = p.add_argument_group("credentials (or env KVMESH_API_KEY, KVMESH_TLS_CA)")
    g.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"), metavar="KEY",
                   help="API key, sent as `authorization: Bearer KEY` (needs --tls-ca)")
    if tls_ca:
        g.add_argument("--tls-ca", default=os.environ.get("KVMESH_TLS_CA"), metavar="PATH",
                       help="CA certificate (PEM) to verify the server with; turns TLS on")
    g.add_argument("--tls-cert", default=os.environ.get("KVMESH_TLS_CERT"), metavar="PATH",
                   help="client certificate (PEM, from the router's --client-ca)")
    g.add_argument("--tls-key", default=os.environ.get("KVMESH_TLS_KEY"), metavar="PATH",
                   help="private key of --tls-cert")


def client_options(args: argparse.Namespace) -> dict:
    """``tls_ca``, ``api_key``, ``tls_cert``, ``tls_key`` of `client_channel` from parsed flags."""
    return {k: getattr(args, k, None) for k in ("tls_ca", "api_key", "tls_cert", "tls_key")}


def channel_credentials(tls_ca: str | None, api_key: str | None, tls_cert: str | None,
                        tls_key: str | None) -> grpc.ChannelCredentials | None:
    """gRPC channel credentials: TLS verified with ``tls_ca`` (PEM file), an optional client
    certificate, and the API key as bearer call credentials; None without ``tls_ca``.

    Raises:
        ValueError: a key or certificate without ``tls_ca``, half a key pair, an unreadable file.
    """
    if not tls_ca:
        if api_key:
            raise ValueError("--api-key needs --tls-ca (or KVMESH_TLS_CA): without TLS the key would cross the network "
                             "in clear")
        if tls_cert or tls_key:
            raise ValueError("--tls-cert/--tls-key need --tls-ca")
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")

    def read(path: str | None, flag: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None

    ca = read(tls_ca, "--tls-ca")
    cert, key = read(tls_cert, "--tls-cert"), read(tls_key, "--tls-key")
    for flag, path, data, marker in (("--tls-ca", tls_ca, ca, b"-----BEGIN CERTIFICATE-----"),
                                     ("--tls-cert", tls_cert, cert, b"-----BEGIN CERTIFICATE-----"),
                                     ("--tls-key", tls_key, key, b"PRIVATE KEY-----")):
        if data is not None and marker not in data:
            raise ValueError(f"{flag} {path}: not a PEM {'private key' if flag == '--tls-key' else 'certificate'} "
                             "(expected a file like the ca.pem / client.pem / client.key that kvmesh up writes)")
    check_api_key(api_key)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if api_key:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(api_key))
    return creds


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError for an API key that cannot be a header value (a line break or other
    control character, e.g. a key pasted with its newline, or a non-ASCII character),
    instead of gRPC's INTERNAL "Invalid metadata"."""
    if api_key and any(c in api_key for c in "\r\n\0"):
        raise ValueError("the API key (--api-key or KVMESH_API_KEY) contains a line break or NUL: copy it again "
                         "without them")
    if api_key and not all(" " < c <= "~" for c in api_key):
        raise ValueError("the API key (--api-key or KVMESH_API_KEY) has a space, control or non-ASCII character; "
                         "keys are printable ASCII: copy it again")


def client_channel(target: str, tls_ca: str | None = None, api_key: str | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None, options: list | tuple = (),
                   aio: bool = False):
    """A channel to a worker or router: TLS (verified with ``tls_ca``) when given, with the
    API key as bearer call credentials; plain otherwise.

    Raises:
        ValueError: an API key or client certificate without ``tls_ca``, or an unreadable file.
    """
    creds = channel_credentials(tls_ca, api_key, tls_cert, tls_key)
    mod = grpc.aio if aio else grpc
    if creds is None:
        return mod.insecure_channel(target, options=list(options))
    return mod.secure_channel(target, creds, options=list(options))
