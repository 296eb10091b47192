"""Transport security of kvmesh processes: TLS credentials from files, and who is calling.

Every process (router, worker) holds one certificate and key (``--tls-cert``, ``--tls-key``)
signed by the cluster CA (``--tls-ca``). It serves that certificate on its gRPC port and
presents it as the client certificate of its own calls to other processes (mutual TLS).
Clients of the router may hold client certificates of their own, signed by a separate CA
(``--client-ca``).

Who a caller is follows from the certificate it presented, checked by the TLS handshake
against the trust store (cluster CA, plus the client CA where given) and then here:

* ``peer``: a certificate issued directly by the cluster CA. Only peers may call the
  cluster-internal RPCs (FetchBlocks, GetSnapshot, ClearCache, Router.Status details) or set
  the cluster-internal request fields (``prefix_location``, ``tenant``). The cluster CA must
  therefore sign nothing but cluster processes; clients get their certificates from the
  client CA (`TlsConfig` refuses a client CA equal to the cluster CA).
* ``client``: a certificate issued by the client CA; its subject common name is the
  client's identity (a tenant id, see `kvmesh.services.auth`).
* ``anonymous``: no certificate (server-authenticated TLS only).

gRPC's Python API can either require a client certificate or not ask for one, nothing in
between. So a port requires one when ``require_client_cert`` is set: workers always (only
peers, and clients of the client CA, reach them), the router when it has a client CA.
A router without ``--client-ca`` serves server-authenticated TLS to API-key clients, and
no caller there is a peer.

Without TLS (``TlsConfig`` is None: local development, ``kvmesh up --insecure``) nothing
can be told apart and every caller counts as a peer, as before TLS existed.

Peers dial each other by address (a pod IP, 127.0.0.1) but check the certificate against
the fixed name `PEER_SERVER_NAME` (``grpc.ssl_target_name_override``), so a cluster
certificate needs that DNS name in its subjectAltName, not every pod's address.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import grpc

__all__ = ["PEER_SERVER_NAME", "TlsConfig", "Caller", "caller_of", "channel_options"]

#: DNS subjectAltName every cluster certificate carries; peers verify each other against it.
PEER_SERVER_NAME = "kvmesh-peer"


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if not data.strip():
        raise ValueError(f"{flag} {path}: the file is empty")
    return data


@dataclass(frozen=True)
class TlsConfig:
    """TLS material of one process, read from PEM files.

    Attributes:
        cert, key: this process's certificate chain and private key (PEM bytes).
        ca: the cluster CA certificate(s) that sign peers (PEM bytes).
        client_ca: CA certificate(s) of client certificates accepted at this port, or b"".
        require_client_cert: the port refuses handshakes without a client certificate
            (default: when there is a client CA).

    Raises:
        ValueError: from `from_files`: a file is missing, unreadable, empty, not PEM, the
            key does not match the certificate, the certificate was not issued by the
            cluster CA or lacks the DNS name `PEER_SERVER_NAME` (with ``peer``), or the
            client CA equals the cluster CA (then every client would be a peer).
    """

    cert: bytes
    key: bytes
    ca: bytes
    client_ca: bytes = b""
    require_client_cert: bool | None = None

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None,
                   client_ca: str | None = None, peer: bool = True) -> "TlsConfig | None":
        """The config of ``--tls-cert/--tls-key/--tls-ca`` (and ``--client-ca``); None when none is given.

        The files are checked as the handshakes later would, so that a process with the
        wrong files stops at start naming the flag: the key must match the certificate, and,
        with ``peer`` (a process that other cluster processes call or that calls them; not
        the vLLM router mode, whose certificate only serves HTTPS), the certificate must be
        issued directly by a ``--tls-ca`` certificate and carry the DNS subjectAltName
        `PEER_SERVER_NAME`.
        """
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            if client_ca:
                raise ValueError("--client-ca needs --tls-cert, --tls-key and --tls-ca (the port's own TLS)")
            return None
        missing = [flag for flag, v in given.items() if not v]
        if missing:
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
        out = cls(_read(cert, "--tls-cert"), _read(key, "--tls-key"), _read(ca, "--tls-ca"),
                  _read(client_ca, "--client-ca") if client_ca else b"")
        for flag, data in (("--tls-cert", out.cert), ("--tls-ca", out.ca), ("--client-ca", out.client_ca)):
            if data and b"-----BEGIN CERTIFICATE-----" not in data:
                raise ValueError(f"{flag}: not a PEM certificate")
        if b"PRIVATE KEY-----" not in out.key:
            raise ValueError("--tls-key: not a PEM private key")
        if out.client_ca and _certs(out.client_ca) & _certs(out.ca):
            raise ValueError("--client-ca must not be the cluster CA (--tls-ca): every certificate the cluster CA "
                             "signs is a peer; issue client certificates from a separate CA")
        _check_pair(out.cert, out.key, cert, key)
        if peer:
            _check_peer_cert(out.cert, out.ca, cert, ca)
        return out

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a gRPC port: this certificate; client certificates (required when
        ``require_client_cert``, else not asked for) verified against the cluster CA and the
        client CA."""
        require = bool(self.client_ca) if self.require_client_cert is None else self.require_client_cert
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca + self.client_ca,
                                           require_client_auth=require)

    def server_ssl_context(self):
        """An `ssl.SSLContext` serving this certificate (the HTTP front beside the gRPC port).

        Client certificates are not requested: HTTP clients authenticate with API keys.
        """
        import os
        import ssl
        import tempfile

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        # the ssl module loads a chain only from files: write it to a private temporary file
        fd, path = tempfile.mkstemp(prefix="kvmesh-tls-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.cert + b"\n" + self.key)
            ctx.load_cert_chain(path)
        finally:
            os.unlink(path)
        return ctx

    def peer_channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a call to another cluster process: verify it against the cluster CA
        and present this process's certificate (mutual TLS)."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def peer_channel(self, address: str, options: list | tuple = ()) -> grpc.aio.Channel:
        """An asyncio mTLS channel to the cluster process at ``address``."""
        return grpc.aio.secure_channel(address, self.peer_channel_credentials(),
                                       options=[*options, *channel_options()])

    def peer_sync_channel(self, address: str, options: list | tuple = ()) -> grpc.Channel:
        """A blocking mTLS channel to the cluster process at ``address`` (launcher, tests)."""
        return grpc.secure_channel(address, self.peer_channel_credentials(), options=[*options, *channel_options()])

    def classify(self, pem: bytes | None) -> "Caller":
        """Who presented the certificate ``pem`` (already verified by the handshake)."""
        if not pem:
            return Caller("anonymous", "")
        kind, name = _classify(pem, self.ca, self.client_ca)
        return Caller(kind, name)


def channel_options() -> list[tuple[str, str]]:
    """Channel options of peer calls: verify the server against `PEER_SERVER_NAME`."""
    return [("grpc.ssl_target_name_override", PEER_SERVER_NAME)]


class Caller(NamedTuple):
    """The caller of one RPC: ``kind`` is ``peer``, ``client`` or ``anonymous``; ``name`` the
    certificate's common name (empty when anonymous)."""

    kind: str
    name: str

    @property
    def is_peer(self) -> bool:
        return self.kind == "peer"


#: Every caller when the port runs without TLS.
TRUSTED = Caller("peer", "")


def caller_of(context, tls: TlsConfig | None) -> Caller:
    """Who is calling, from a gRPC servicer context (sync or asyncio) and this port's TLS config."""
    if tls is None:
        return TRUSTED
    auth = context.auth_context() or {}
    if b"ssl" not in auth.get("transport_security_type", []):
        return Caller("anonymous", "")
    pems = auth.get("x509_pem_cert") or []
    return tls.classify(pems[0] if pems else None)


def _certs(pem: bytes) -> set[bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    return {c.public_bytes(Encoding.DER) for c in x509.load_pem_x509_certificates(pem)}


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_path: str, key_path: str) -> None:
    """Raise ValueError unless ``key_pem`` is the private key of the first certificate in ``cert_pem``."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import (Encoding, PublicFormat,
                                                              load_pem_private_key)

    try:
        leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ValueError(f"--tls-cert {cert_path}: not a readable PEM certificate ({exc})") from None
    try:
        key = load_pem_private_key(key_pem, password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise ValueError(f"--tls-key {key_path}: the key is encrypted; give it unencrypted (e.g. "
                         "`openssl pkey -in KEY -out KEY.plain`) and keep the file private") from None
    except Exception as exc:  # ValueError, or cryptography's UnsupportedAlgorithm
        raise ValueError(f"--tls-key {key_path}: not a readable PEM private key ({exc})") from None

    def spki(public_key) -> bytes:
        return public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)

    if spki(key.public_key()) != spki(leaf.public_key()):
        raise ValueError(f"--tls-key {key_path} is not the private key of --tls-cert {cert_path} (the two files "
                         "do not belong together): give the key that was issued with that certificate")


def _check_peer_cert(cert_pem: bytes, ca_pem: bytes, cert_path: str, ca_path: str) -> None:
    """Raise ValueError unless the first certificate in ``cert_pem`` was issued directly by a
    certificate of ``ca_pem`` and names `PEER_SERVER_NAME` in its DNS subjectAltName: what
    other cluster processes check when they call this one (and `_classify` when it calls them)."""
    from cryptography import x509

    leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise ValueError(f"--tls-ca {ca_path}: not a readable PEM certificate ({exc})") from None
    if not _issued_by_any(leaf, cas):
        raise ValueError(f"--tls-cert {cert_path} (issuer {leaf.issuer.rfc4514_string()!r}) was not issued by "
                         f"--tls-ca {ca_path} (the cluster CA, {cas[0].subject.rfc4514_string()!r}): peers would "
                         "refuse it; give a certificate the cluster CA signed directly, or that CA")
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if PEER_SERVER_NAME not in names:
        raise ValueError(f"--tls-cert {cert_path} lacks the DNS subjectAltName {PEER_SERVER_NAME!r} (it has "
                         f"{names or 'none'}): peers verify every cluster process against that name; reissue "
                         f"the certificate with it (docs/SECURITY.md)")


@functools.lru_cache(maxsize=1024)
def _classify(pem: bytes, ca: bytes, client_ca: bytes) -> tuple[str, str]:
    """(kind, common name) of a handshake-verified certificate: ``peer`` when a cluster CA
    issued it directly, ``client`` otherwise (the handshake only admits the two CAs)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(names[0].value) if names else ""
    if _issued_by_any(cert, x509.load_pem_x509_certificates(ca)):
        return "peer", name
    return ("client", name) if client_ca else ("anonymous", "")


def _issued_by_any(cert, cas) -> bool:
    """Whether one of ``cas`` (cryptography certificates) issued ``cert`` directly."""
    from cryptography.exceptions import InvalidSignature

    for issuer in cas:
        try:
            cert.verify_directly_issued_by(issuer)
            return True
        except (ValueError, TypeError, InvalidSignature):  # wrong issuer name, key type or signature
            continue
    return False
