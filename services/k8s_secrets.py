"""Kubernetes Secrets of a secure kvmesh cluster, generated offline.

``python -m kvmesh.services.k8s_secrets --namespace NS --out-dir DIR > secrets.yaml``
prints four Secrets as YAML, for ``kubectl apply -f secrets.yaml``:

* ``kvmesh-tls`` (type ``kubernetes.io/tls``; keys ``tls.crt``, ``tls.key``, ``ca.crt``):
  one certificate for the routers and workers (``--tls-cert``/``--tls-key``), issued by a
  new cluster CA (``--tls-ca``), with DNS subjectAltNames ``kvmesh-peer`` (the name peers
  verify each other by, `kvmesh.workers.tls.PEER_SERVER_NAME`) and the router Service's
  names (``kvmesh-router``, ``kvmesh-router.NS``, ``kvmesh-router.NS.svc``,
  ``kvmesh-router.NS.svc.cluster.local``) plus any ``--dns`` given;
* ``kvmesh-api-keys`` (key ``api-keys``): the router's ``--api-keys`` file with one key
  per ``--tenant``, stored as SHA-256 (`kvmesh.services.auth.hash_key`);
* ``kvmesh-ray-auth`` (key ``token``): a random Ray authentication token for the ``ray``
  overlay (``RAY_AUTH_MODE=token`` on the Ray pods and the driver; unused elsewhere);
* ``kvmesh-record-key`` (key ``record.key``): the remote tier's record MAC key, for workers
  run with ``--remote-bytes`` (mount it and pass ``--remote-record-key-file``; docs/DEPLOY.md).

The CA's private key and the plaintext API keys never go into the YAML: they are written
to ``--out-dir`` (created 0700; a folder that its group or others may write is refused;
keys 0600 even where a file with another mode was, and a symlink in place of an output file
is refused, never followed): ``ca.crt`` and ``ca.key`` (keep the key offline;
it mints peers), and ``client.env`` with ``KVMESH_TLS_CA`` and ``KVMESH_API_KEY`` for the
first tenant. Certificates come from `kvmesh.services.credentials` (ECDSA P-256,
RFC 5280 profiles); Secret objects follow the Kubernetes core/v1 Secret schema.
"""
from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys

import yaml

from kvmesh.services.auth import hash_key
from kvmesh.services.credentials import _pem_cert, _pem_key, _write, issue_certificate, make_ca
from kvmesh.workers.tls import PEER_SERVER_NAME

__all__ = ["router_names", "cluster_secrets", "main"]

#: Files written to ``--out-dir``.
OUTPUTS = ("ca.crt", "ca.key", "client.env")
LABELS = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/part-of": "kvmesh"}


def router_names(namespace: str, service: str = "kvmesh-router") -> list[str]:
    """DNS names clients dial the router Service by, in namespace ``namespace``."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _secret(name: str, data: dict[str, bytes], namespace: str | None, type_: str = "Opaque") -> dict:
    meta = {"name": name, "labels": dict(LABELS)}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": type_,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def cluster_secrets(namespace: str = "default", tenants: tuple[str, ...] = ("default",),
                    dns: tuple[str, ...] = (), days: int = 365, set_namespace: bool = True):
    """``(secrets, ca_cert_pem, ca_key_pem, api_keys)``: the Secret objects (dicts) and what
    stays with the operator; ``api_keys`` maps each tenant to its new plaintext key.

    Raises:
        ValueError: no tenant, or a tenant id with whitespace.
    """
    if not tenants:
        raise ValueError("give at least one --tenant")
    for t in tenants:
        if not t or any(ch.isspace() for ch in t) or t.startswith("#"):
            raise ValueError(f"--tenant {t!r}: a tenant id is one word")
    ca_cert, ca_key = make_ca("kvmesh cluster CA", days=days)
    names = (PEER_SERVER_NAME, *router_names(namespace), *dns)
    cert, key = issue_certificate(ca_cert, ca_key, "kvmesh-peer", dns=tuple(dict.fromkeys(names)), days=days)
    api_keys = {t: "kvm_" + secrets.token_urlsafe(32) for t in tenants}
    lines = "# tenant  key (SHA-256 of the API key)\n" + "".join(f"{t}  {hash_key(k)}\n" for t, k in api_keys.items())
    ns = namespace if set_namespace else None
    objs = [_secret("kvmesh-tls", {"tls.crt": _pem_cert(cert), "tls.key": _pem_key(key), "ca.crt": _pem_cert(ca_cert)},
                    ns, "kubernetes.io/tls"),
            _secret("kvmesh-api-keys", {"api-keys": lines.encode()}, ns),
            _secret("kvmesh-ray-auth", {"token": secrets.token_hex(32).encode()}, ns),
            _secret("kvmesh-record-key", {"record.key": (secrets.token_hex(32) + "\n").encode()}, ns)]
    return objs, _pem_cert(ca_cert), _pem_key(ca_key), api_keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.services.k8s_secrets",
                                description="Print the Secrets kvmesh-tls, kvmesh-api-keys, kvmesh-ray-auth and kvmesh-record-key as YAML "
                                            "(docs/DEPLOY.md); keep the CA key and API keys in --out-dir.")
    p.add_argument("--namespace", default="default", help="namespace of the cluster (router Service names, "
                   "metadata.namespace); default 'default'")
    p.add_argument("--tenant", action="append", default=None,
                   help="tenant id to issue an API key for (repeatable; default: one tenant 'default')")
    p.add_argument("--dns", action="append", default=[],
                   help="another DNS name clients reach the router by, e.g. an Ingress host (repeatable)")
    p.add_argument("--days", type=int, default=365, help="validity of the CA and certificate (default 365)")
    p.add_argument("--out-dir", required=True, help="folder for ca.crt, ca.key and client.env (created 0700; one its group or others "
                   "may write is refused)")
    p.add_argument("--force", action="store_true",
                   help="replace a CA key and client.env already in --out-dir (the old CA and API keys are lost)")
    args = p.parse_args(argv)
    import re

    # Kubernetes names: a namespace is an RFC 1123 label, a DNS name an RFC 1123 subdomain
    label = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
    if not re.fullmatch(label, args.namespace):
        print(f"error: --namespace {args.namespace!r} is not a Kubernetes namespace name (lowercase letters, digits "
              "and '-', 1-63 characters, starting and ending with a letter or digit)", file=sys.stderr)
        return 2
    bad = next((d for d in args.dns if len(d) > 253 or not re.fullmatch(rf"(\*\.)?{label}(\.{label})*", d)), None)
    if bad is not None:
        print(f"error: --dns {bad!r} is not a DNS name (lowercase labels of letters, digits and '-', joined by '.')",
              file=sys.stderr)
        return 2
    if args.days < 1:
        print(f"error: --days must be >= 1 (got {args.days})", file=sys.stderr)
        return 2
    links = [n for n in OUTPUTS if os.path.islink(os.path.join(args.out_dir, n))]
    if links:  # a link would have the CA key written wherever it points
        print(f"error: {' and '.join(os.path.join(args.out_dir, n) for n in links)} "
              f"{'is a symbolic link' if len(links) == 1 else 'are symbolic links'}; the CA key and API keys are "
              "never written through a link. Remove the link (the files are written in --out-dir itself) or use "
              "another --out-dir", file=sys.stderr)
        return 2
    there = [n for n in ("ca.key", "client.env") if os.path.lexists(os.path.join(args.out_dir, n))]
    if there and not args.force:
        print(f"error: {args.out_dir} already holds {' and '.join(there)}: a new run makes a new CA and new API "
              "keys, and the old ones (perhaps the only copy of the CA key) would be lost. Use another --out-dir, "
              "or pass --force to replace them", file=sys.stderr)
        return 2
    try:
        objs, ca_pem, ca_key_pem, api_keys = cluster_secrets(args.namespace, tuple(args.tenant or ("default",)),
                                                             tuple(args.dns), args.days)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = lambda name: os.path.join(args.out_dir, name)  # noqa: E731
    first = next(iter(api_keys))
    env = f"KVMESH_TLS_CA={os.path.abspath(out('ca.crt'))}\nKVMESH_API_KEY={api_keys[first]}\n"
    env += "".join(f"# tenant {t}: KVMESH_API_KEY={k}\n" for t, k in list(api_keys.items())[1:])
    try:
        os.makedirs(args.out_dir, mode=0o700, exist_ok=True)
        mode = os.stat(args.out_dir).st_mode & 0o777
        if mode & 0o022:
            print(f"error: --out-dir {args.out_dir} is writable by {'others' if mode & 0o002 else 'its group'} "
                  f"(mode {mode:04o}): whoever can write there could replace or link ca.key and client.env. "
                  f"Restrict it (chmod 700 {args.out_dir}) or use a new folder, which is created 0700",
                  file=sys.stderr)
            return 2
        _write(out("ca.crt"), ca_pem, private=False)
        _write(out("ca.key"), ca_key_pem, private=True)
        _write(out("client.env"), env.encode(), private=True)
    except OSError as exc:  # not a folder, no permission, a read-only or missing parent
        print(f"error: cannot write to --out-dir {args.out_dir}: {exc.strerror or exc}; "
              "give a folder you can create and write", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    print(f"wrote {out('ca.crt')}, {out('ca.key')} (keep offline) and {out('client.env')} (API keys of "
          f"{', '.join(api_keys)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
