"""API keys to tenants, TLS material checks, flag refusals and URL redaction (no processes)."""
from __future__ import annotations

import hashlib

import pytest

from kvmesh.services.auth import SHARED_TENANT, Authenticator, Forbidden, Unauthenticated, hash_key


@pytest.fixture()
def keys_file(tmp_path):
    p = tmp_path / "api-keys"
    p.write_text(f"# tenant key options\nacme {hash_key('acme-key-000000000000')}  shared\n"
                 "beta beta-key-1111111111111  # plain keys are hashed at load\n"
                 f"beta {hash_key('beta-key-rotated-22222')}\ngamma cert:gamma-gateway\n")
    return str(p)


def test_keys_resolve_to_their_tenant(keys_file):
    auth = Authenticator.from_file(keys_file)
    assert auth.tenant_for("Bearer acme-key-000000000000") == "acme"
    assert auth.tenant_for("bearer beta-key-1111111111111") == "beta"
    assert auth.tenant_for("Bearer beta-key-rotated-22222") == "beta"  # two keys, one tenant: rotation
    assert auth.tenant_for(None, peer_identity="gamma-gateway") == "gamma"  # a mapped client certificate
    assert auth.tenant_for("Bearer acme-key-000000000000", peer_identity="gamma-gateway") == "acme"  # key first
    with pytest.raises(Unauthenticated):
        auth.tenant_for(None, peer_identity="alice")  # a certificate nobody mapped
    for bad in (None, "", "Bearer nope-not-a-key-0000", "Basic acme-key-000000000000", "Bearer "):
        with pytest.raises(Unauthenticated):
            auth.tenant_for(bad)


def test_a_hash_inside_a_key_is_part_of_it_and_a_spaced_one_starts_a_comment(tmp_path):
    """A key with "#" in it was once cut at the "#": its clients were refused, and the
    prefix was what the file accepted."""
    p = tmp_path / "keys"
    p.write_text("acme my-secret-key-1234#tail  # the acme gateway\n#beta beta-key-1111111111111\n")
    auth = Authenticator.from_file(str(p))
    assert auth.tenant_for("Bearer my-secret-key-1234#tail") == "acme"
    with pytest.raises(Unauthenticated):
        auth.tenant_for("Bearer my-secret-key-1234")
    with pytest.raises(Unauthenticated):
        auth.tenant_for("Bearer beta-key-1111111111111")  # a commented-out line


def test_open_mode_has_one_tenant_and_ignores_keys():
    auth = Authenticator.open()
    assert auth.tenant_for(None) == ""
    assert auth.tenant_for(None, peer_identity="alice") == "cert:alice"
    assert auth.scope("", "shared:x") == ("", "shared:x")
    # OpenAI client libraries always send a key: without a key file it names no tenant
    assert auth.tenant_for("Bearer some-key-0000000000000") == auth.tenant_for(None)


def test_shared_namespace_needs_the_option(keys_file):
    auth = Authenticator.from_file(keys_file)
    assert auth.scope("acme", "shared:sys") == (SHARED_TENANT, "sys")
    assert auth.scope("beta", "private") == ("beta", "private")
    with pytest.raises(Forbidden):
        auth.scope("beta", "shared:sys")


@pytest.mark.parametrize("line, needle", [("acme", "TENANT KEY"), ("acme cert:", "common name"), ("ac/me k" + "x" * 20, "tenant id"),
                                          ("acme short", "16 characters"), ("acme sha256:abc", "64 hex"),
                                          ("acme " + "k" * 20 + " admin", "TENANT KEY")])
def test_bad_key_files_name_the_line_and_never_echo_keys(tmp_path, line, needle):
    p = tmp_path / "keys"
    p.write_text("# header\n" + line + "\n")
    with pytest.raises(ValueError) as err:
        Authenticator.from_file(str(p))
    assert needle in str(err.value) and "line 2" in str(err.value)
    assert "k" * 20 not in str(err.value)


def test_tls_config_checks_its_files(tmp_path):
    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.workers.tls import TlsConfig

    c = generate_cluster_credentials(str(tmp_path / "run"))
    assert TlsConfig.from_files(None, None, None) is None
    tls = TlsConfig.from_files(c.cert, c.key, c.ca)
    assert tls.classify(open(c.cert, "rb").read()).is_peer
    with pytest.raises(ValueError, match="missing --tls-ca"):
        TlsConfig.from_files(c.cert, c.key, None)
    with pytest.raises(ValueError, match="must not be the cluster CA"):
        TlsConfig.from_files(c.cert, c.key, c.ca, client_ca=c.ca)
    with pytest.raises(ValueError, match="--tls-key"):
        TlsConfig.from_files(c.cert, str(tmp_path / "absent"), c.ca)
    other = generate_cluster_credentials(str(tmp_path / "other"))  # another CA's certificate is a client
    tls2 = TlsConfig.from_files(c.cert, c.key, c.ca, client_ca=other.ca)
    kind, name = tls2.classify(open(other.cert, "rb").read())
    assert kind == "client" and name == "kvmesh-local-peer"
    assert (tmp_path / "run" / "ca.key").stat().st_mode & 0o077 == 0  # private keys are 0600


def test_tls_config_refuses_files_the_handshakes_would(tmp_path):
    """A key of another certificate, a certificate another CA issued, or one without the DNS
    name peers verify (`PEER_SERVER_NAME`) is a ValueError naming the flag at start, not a
    traceback once serving or a peer's refused handshake later. The vLLM router mode's
    certificate (``peer=False``) only needs its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from kvmesh.services.credentials import generate_cluster_credentials, issue_certificate, write_cert_and_key
    from kvmesh.workers.tls import TlsConfig

    c = generate_cluster_credentials(str(tmp_path / "run"))
    other = generate_cluster_credentials(str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"--tls-key .*client.key is not the private key of --tls-cert .*peer.pem"):
        TlsConfig.from_files(c.cert, c.client_key, c.ca)
    with pytest.raises(ValueError, match=r"--tls-key .* is not the private key"):
        TlsConfig.from_files(c.cert, c.key.replace("run", "other"), c.ca, peer=False)
    with pytest.raises(ValueError, match=r"--tls-cert .*other.*peer.pem .* was not issued by --tls-ca .*run.*ca.pem"):
        TlsConfig.from_files(other.cert, other.key, c.ca)
    with pytest.raises(ValueError, match=r"was not issued by --tls-ca"):  # the client CA is not the cluster CA
        TlsConfig.from_files(c.client_cert, c.client_key, c.ca)

    ca_cert = x509.load_pem_x509_certificate(open(c.ca, "rb").read())
    ca_key = load_pem_private_key(open(c.ca_key, "rb").read(), None)
    for name, dns in (("no-san", ()), ("other-name", ("localhost",))):
        cert, key = issue_certificate(ca_cert, ca_key, "kvmesh-peer", dns=dns, ips=("127.0.0.1",))
        write_cert_and_key(cert, key, str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"))
        with pytest.raises(ValueError, match=r"--tls-cert .* lacks the DNS subjectAltName 'kvmesh-peer'"):
            TlsConfig.from_files(str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"), c.ca)
        # HTTPS only (the vLLM router mode): the pair is enough
        assert TlsConfig.from_files(str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"), c.ca,
                                    peer=False) is not None
    assert TlsConfig.from_files(c.client_cert, c.client_key, c.ca, peer=False) is not None
    assert TlsConfig.from_files(c.cert, c.key, c.ca, client_ca=c.client_ca) is not None  # what kvmesh up passes


def test_kubernetes_secrets_pass_the_tls_checks(tmp_path):
    """The certificate `k8s_secrets` writes into kvmesh-tls is what router and workers accept."""
    import base64

    from kvmesh.services.k8s_secrets import cluster_secrets
    from kvmesh.workers.tls import TlsConfig

    objs, *_ = cluster_secrets("kvmesh", days=2)
    tls = next(o for o in objs if o["metadata"]["name"] == "kvmesh-tls")
    for field in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / field).write_bytes(base64.b64decode(tls["data"][field]))
    assert TlsConfig.from_files(*(str(tmp_path / f) for f in ("tls.crt", "tls.key", "ca.crt"))) is not None


def test_non_loopback_bind_without_tls_refuses_to_start(capsys):
    from kvmesh.services.cli import build_parser, cmd_worker
    from kvmesh.services.cluster_cli import cmd_router

    p = build_parser()
    args = p.parse_args(["worker", "--port", "1", "--host", "0.0.0.0", "--advertise", "10.0.0.7:1"])
    assert cmd_worker(args) == 2  # before any model loads
    assert "--insecure" in capsys.readouterr().err
    args = p.parse_args(["router", "--port", "1", "--host", "10.1.2.3", "--redis-url", "redis://127.0.0.1:1/0"])
    assert cmd_router(args) == 2
    assert "TLS is off" in capsys.readouterr().err


def test_redis_passwords_are_redacted():
    from kvmesh.services.security import redact_url

    assert redact_url("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redact_url("at redis://user:pw@h:1/0 and rediss://:x@h2:2") == "at redis://user:***@h:1/0 and rediss://:***@h2:2"
    assert redact_url("redis://10.0.0.1:6379/0") == "redis://10.0.0.1:6379/0"


def test_api_key_needs_tls_on_the_client():
    from kvmesh.services.security import client_channel

    with pytest.raises(ValueError, match="--tls-ca"):
        client_channel("127.0.0.1:1", api_key="k" * 20)


def test_an_http_front_without_keys_on_a_port_that_requires_certificates_is_refused(tmp_path):
    """The HTTPS front cannot see client certificates: with --client-ca (router) or on a worker
    (peers only) and no --api-keys, --http-port would serve anyone what gRPC serves only to
    certificate holders. Refused at start; with keys, or without the front, it starts."""
    import argparse

    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.services.security import server_gate

    c = generate_cluster_credentials(str(tmp_path / "run"))

    def flags(**kw):
        base = dict(tls_cert=c.cert, tls_key=c.key, tls_ca=c.ca, client_ca=None, api_keys=None, insecure=False,
                    host="127.0.0.1", http_port=None)
        return argparse.Namespace(**{**base, **kw})

    for args, worker in ((flags(client_ca=c.client_ca, http_port=0), False), (flags(http_port=8080), True)):
        with pytest.raises(ValueError, match="--http-port would open this") as err:
            server_gate(args, worker=worker)
        assert "--api-keys" in str(err.value)
    assert server_gate(flags(client_ca=c.client_ca, http_port=0, api_keys=c.api_keys)).auth.requires_key
    server_gate(flags(http_port=-1), worker=True)  # -1: the front is off
    server_gate(flags(http_port=0))  # no client certificates asked for: the front is what the port is


@pytest.mark.parametrize("second", ["beta {key}", "beta sha256:{digest}", "acme {key} shared"])
def test_a_key_on_two_lines_is_refused_naming_both_lines(tmp_path, second):
    """One key (as itself or as its digest) on two lines: an error naming both lines, never
    the key; before, the later line silently won."""
    key = "dup-key-" + "q" * 20
    p = tmp_path / "keys"
    p.write_text("# header\nacme " + key + "\nother other-key-0123456789\n"
                 + second.format(key=key, digest=hashlib.sha256(key.encode()).hexdigest()) + "\n")
    with pytest.raises(ValueError) as err:
        Authenticator.from_file(str(p))
    assert "lines 2 and 4" in str(err.value), str(err.value)
    assert key not in str(err.value) and hashlib.sha256(key.encode()).hexdigest() not in str(err.value)


def test_two_cert_lines_for_one_name_are_refused(tmp_path):
    p = tmp_path / "keys"
    p.write_text("acme cert:gw\nbeta cert:gw\n")
    with pytest.raises(ValueError, match="lines 1 and 2: the same certificate name"):
        Authenticator.from_file(str(p))
