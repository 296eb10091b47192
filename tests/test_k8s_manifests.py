"""The k8s/ overlays, rendered with `kubectl kustomize`, without a cluster.

Every overlay renders and validates strictly (kubernetes-validate) against Kubernetes
1.30 and the newest version the validator bundles; custom resources (RayCluster,
ScaledObject) are checked here. Over the rendered objects: probes, resources and
security context on every container; Services, PDBs, HPAs and NetworkPolicies point at
pods and ports that exist; and every kvmesh container's command line parses with
kvmesh's own CLI parser and passes its start-up checks, so a manifest cannot drift from
the CLI.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import inspect
import io
import os
import re
from unittest import mock

import kubernetes_validate
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.services.cli import advertised_address, build_parser, parse_bytes, tier_config
from tests._k8s import (OVERLAYS, WORKLOAD_KINDS, container_argv, container_env, find, labels_match,
                        parse_quantity, pod_templates, render)

K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
CUSTOM_KINDS = {("ray.io/v1", "RayCluster"), ("keda.sh/v1alpha1", "ScaledObject")}
#: Secrets and volumes the operator creates (docs/DEPLOY.md), per overlay; values are
#: stand-ins used only to expand command lines.
OPERATOR_SECRETS = {
    ("kvmesh-redis", "password"): "operator-password",
    ("kvmesh-redis-url", "url"): "redis://:operator-password@redis.example.internal:6379/0",
    ("kvmesh-ray-auth", "token"): "0123456789abcdef" * 4,
}
#: Secrets mounted as files, which the operator creates (python -m kvmesh.services.k8s_secrets)
FILE_SECRETS = {"kvmesh-tls": {"tls.crt", "tls.key", "ca.crt"}, "kvmesh-api-keys": {"api-keys"}}
#: Everything `kvmesh.services.k8s_secrets` makes: the file Secrets and the Ray token (env)
GENERATED_SECRETS = {**FILE_SECRETS, "kvmesh-ray-auth": {"token"}, "kvmesh-record-key": {"record.key"}}
OPERATOR_PVCS = {"kvmesh-model"}
DOWNWARD = {"status.podIP": "10.0.3.7", "metadata.name": "kvmesh-worker-0"}
SERVICE_NAMES = {"router": pb.DESCRIPTOR.services_by_name["Router"].full_name,
                 "worker": pb.DESCRIPTOR.services_by_name["Worker"].full_name}


def test_overlays_listed():
    assert {"cpu", "gpu", "external-redis", "ray"} <= set(OVERLAYS)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def containers(objs):
    for owner, tpl in pod_templates(objs):
        for c in tpl["spec"]["containers"]:
            yield owner, tpl, c


def kvmesh_containers(objs):
    for owner, tpl, c in containers(objs):
        if c.get("command", [None])[0] == "kvmesh":
            yield owner, tpl, c


def parse_cli(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    """``argv`` parsed by kvmesh's parser in the container's environment ``env`` (flags such
    as --redis-url default to KVMESH_* variables)."""
    assert argv[0] == "kvmesh", argv
    unexpanded = [a for a in argv if re.search(r"\$\(", a)]
    assert not unexpanded, f"unresolved $(VAR) in {argv}: {unexpanded}"
    err = io.StringIO()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    environ.update(env or {})
    try:
        with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, environ, clear=True):
            return build_parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"kvmesh CLI rejects {argv[1:]}: {err.getvalue()}") from None


def resolved(objs, c):
    env = container_env(c, objs, DOWNWARD, OPERATOR_SECRETS)
    return env, container_argv(c, env)


def parsed(objs, c) -> argparse.Namespace:
    env, argv = resolved(objs, c)
    return parse_cli(argv, env)


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory):
    """The operator's Secrets as `kvmesh.services.k8s_secrets` generates them: {name: {key: bytes}}."""
    from kvmesh.services.k8s_secrets import cluster_secrets

    objs, _, _, keys = cluster_secrets("kvmesh-test", days=1)
    out = {o["metadata"]["name"]: {k: base64.b64decode(v) for k, v in o["data"].items()} for o in objs}
    assert set(out) == set(GENERATED_SECRETS) and all(set(out[n]) == GENERATED_SECRETS[n] for n in out)
    return out


def mounted_paths(tpl: dict, c: dict, secrets: dict, tmp) -> dict[str, str]:
    """{path in the container: local file} for every file of a Secret volume ``c`` mounts."""
    volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        sec = volumes.get(m["name"], {}).get("secret")
        if not sec or sec["secretName"] not in secrets:
            continue
        data = secrets[sec["secretName"]]
        items = sec.get("items") or [{"key": k, "path": k} for k in data]
        for it in items:
            assert it["key"] in data, f"volume {m['name']} projects missing key {it['key']}"
            local = tmp / sec["secretName"] / it["path"]
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data[it["key"]])
            out[f"{m['mountPath'].rstrip('/')}/{it['path']}"] = str(local)
    return out


# -- rendering and schema ---------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_validates_strictly(rendered, version):
    overlay, objs = rendered
    assert objs, f"{overlay} renders nothing"
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for "
                                 f"Kubernetes {version}: {exc.message} at {list(exc.path)}") from None


def test_only_known_custom_kinds(rendered):
    overlay, objs = rendered
    for obj in objs:
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if group.endswith((".io", ".sh")) and not group.endswith("k8s.io"):
            assert (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS, f"{overlay}: unchecked custom kind {obj['kind']}"


# -- every container --------------------------------------------------------------------

def test_probes_resources_security(rendered):
    overlay, objs = rendered
    assert list(containers(objs)), overlay
    for owner, tpl, c in containers(objs):
        where = f"{overlay}: {owner}/{c['name']}"
        assert "readinessProbe" in c and "livenessProbe" in c, f"{where}: readiness and liveness probes"
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{where}: cpu and memory {kind}"
        for r in res["limits"]:
            if r in res["requests"]:
                assert parse_quantity(res["requests"][r]) <= parse_quantity(res["limits"][r]), f"{where}: {r}"
        if "nvidia.com/gpu" in res["limits"]:
            assert res["requests"].get("nvidia.com/gpu") == res["limits"]["nvidia.com/gpu"], where
            assert any(t.get("key") == "nvidia.com/gpu" for t in tpl["spec"].get("tolerations", [])), \
                f"{where}: GPU pods tolerate the nvidia.com/gpu taint"
        pod_sec = tpl["spec"].get("securityContext", {})
        sec = c.get("securityContext", {})
        assert sec.get("runAsNonRoot", pod_sec.get("runAsNonRoot")) is True, f"{where}: runAsNonRoot"
        assert sec.get("readOnlyRootFilesystem") is True, f"{where}: read-only root filesystem"
        assert sec.get("allowPrivilegeEscalation") is False, f"{where}: no privilege escalation"
        assert sec.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: drop all capabilities"
        assert tpl["spec"].get("automountServiceAccountToken") is False, f"{where}: no API token mounted"
        assert tpl["spec"].get("serviceAccountName") == "kvmesh", where


def test_writable_mounts_only_where_needed(rendered):
    overlay, objs = rendered
    for owner, tpl, c in containers(objs):
        volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        for vct in next((o["spec"].get("volumeClaimTemplates", []) for o in objs
                         if o["kind"] == "StatefulSet" and o["metadata"]["name"] == owner), []):
            volumes[vct["metadata"]["name"]] = {"persistentVolumeClaim": {}}
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"])
            assert v is not None, f"{overlay}: {owner} mounts undefined volume {m['name']}"
            if "secret" in v or "configMap" in v:
                assert m.get("readOnly") is True, f"{overlay}: {owner} mounts {m['name']} writable"
            if "secret" in v and v["secret"]["secretName"] in FILE_SECRETS:
                assert not v["secret"].get("optional"), \
                    f"{overlay}: {m['name']}: the pod must not start without its certificates or keys"
            if not m.get("readOnly"):
                assert "emptyDir" in v or "persistentVolumeClaim" in v, f"{overlay}: {owner} {m['name']}"
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"].get("claimName"):
                name = v["persistentVolumeClaim"]["claimName"]
                assert find(objs, "PersistentVolumeClaim", name) or name in OPERATOR_PVCS, name


def test_kvmesh_servers_probe_their_grpc_service(rendered):
    """TLS ports cannot take the kubelet's plaintext gRPC probe: each probe execs
    kvmesh.services.probe against the container's own port, service and certificates."""
    from kvmesh.services import probe as probe_mod

    overlay, objs = rendered
    for owner, tpl, c in kvmesh_containers(objs):
        args = parsed(objs, c)
        if args.command not in SERVICE_NAMES:
            continue
        where = f"{overlay}: {owner}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = c[probe].get("exec", {}).get("command", [])
            assert cmd[:3] == ["python", "-m", "kvmesh.services.probe"], f"{where}: {probe} execs the TLS probe"
            p = probe_mod.build_parser().parse_args(cmd[3:])
            host, _, port = p.target.rpartition(":")
            assert host == "127.0.0.1" and int(port) == args.port, f"{where}: {probe} target {p.target} != --port"
            assert p.service == SERVICE_NAMES[args.command], f"{where}: {probe} service"
            assert (p.tls_ca, p.tls_cert, p.tls_key) == (args.tls_ca, args.tls_cert, args.tls_key), \
                f"{where}: {probe} uses the server's own certificates"
            assert c[probe].get("timeoutSeconds", 1) >= 3, f"{where}: {probe}: an interpreter start needs > 1 s"
        assert any(p["containerPort"] == args.port for p in c["ports"]), f"{where}: --port is a container port"
        # graceful drain: preStop, then the server's own stop grace, inside the grace period
        from kvmesh.workers.grpc_host import GrpcHost

        drain_s = inspect.signature(GrpcHost.stop).parameters["grace_s"].default
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[0] == "sleep", f"{where}: preStop sleeps while endpoints and leases update"
        assert tpl["spec"]["terminationGracePeriodSeconds"] >= float(pre[1]) + drain_s + 10, where


def test_command_lines_parse_with_the_cli(rendered, secret_files, tmp_path):
    overlay, objs = rendered
    seen = 0
    for owner, tpl, c in kvmesh_containers(objs):
        env, argv = resolved(objs, c)
        args = parse_cli(argv, env)
        seen += 1
        where = f"{overlay}: {owner}"
        if args.command == "worker":
            tier_config(args).validate()
            assert advertised_address(args.host, args.port, args.advertise) == f"{DOWNWARD['status.podIP']}:{args.port}"
            assert args.worker_id == DOWNWARD["metadata.name"], f"{where}: --worker-id is the pod name"
            assert args.redis_url, f"{where}: workers publish to Redis"
            mem_limit = parse_quantity(c["resources"]["limits"]["memory"])
            assert args.host_bytes <= 0.8 * mem_limit, f"{where}: --host-bytes over 80% of the memory limit"
            sts = find(objs, "StatefulSet", owner)[0]
            disk = next(m for m in c["volumeMounts"] if m["mountPath"] == args.disk_dir)
            vct = next(v for v in sts["spec"]["volumeClaimTemplates"] if v["metadata"]["name"] == disk["name"])
            assert args.disk_bytes <= parse_quantity(vct["spec"]["resources"]["requests"]["storage"]), where
            if "nvidia.com/gpu" in c["resources"]["limits"]:
                assert args.device.startswith("cuda") and args.model, f"{where}: GPU workers run a real model"
        elif args.command == "router":
            assert args.redis_url and args.host == "0.0.0.0", where
        elif args.command == "ray":
            from kvmesh.services.ray_cli import check_args

            assert check_args(args) is None, f"{where}: {check_args(args)}"
        else:
            raise AssertionError(f"{where}: unexpected kvmesh command {args.command}")
        if args.command in ("router", "worker"):
            check_security_and_metrics(where, argv, env, args, tpl, c, objs, secret_files, tmp_path / owner)
    assert seen, f"{overlay}: no kvmesh container"


def check_security_and_metrics(where: str, argv: list[str], env: dict, args: argparse.Namespace, tpl: dict,
                               c: dict, objs: list[dict], secrets: dict, tmp) -> None:
    """Routers and workers run secure: TLS from the mounted Secret, the Redis password only
    in the environment, metrics (and the router's HTTP front) on declared ports; and the
    start-up checks of `server_gate` pass on the Secrets' files."""
    from kvmesh.services.security import server_gate

    assert not args.insecure, f"{where}: --insecure"
    assert args.tls_cert and args.tls_key and args.tls_ca, f"{where}: binds {args.host} without TLS"
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        assert str(getattr(args, flag)).startswith("/etc/kvmesh/tls/"), f"{where}: --{flag.replace('_', '-')}"
    assert "--redis-url" not in argv, f"{where}: the Redis URL comes from KVMESH_REDIS_URL, not argv"
    password = args.redis_url.split("@")[0].rpartition(":")[2]
    assert password and not any(password in a for a in argv), f"{where}: the Redis password is in argv"
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    assert args.metrics_port == port, f"{where}: --metrics-port {args.metrics_port} != metrics port {port}"
    if args.command == "router":
        assert args.api_keys and args.api_keys.startswith("/etc/kvmesh/auth/"), f"{where}: --api-keys"
        http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        assert args.http_port == http, f"{where}: --http-port {args.http_port} != http port {http}"
        svc = find(objs, "Service", "kvmesh-router")
        assert svc and any(p.get("targetPort") == "http" for p in svc[0]["spec"]["ports"]), \
            f"{where}: the kvmesh-router Service exposes the HTTP front"
    # start-up checks on the files the Secrets mount (as generated by kvmesh.services.k8s_secrets)
    files = mounted_paths(tpl, c, secrets, tmp)
    local = argparse.Namespace(**vars(args))
    for flag in ("tls_cert", "tls_key", "tls_ca", "client_ca", "api_keys"):
        path = getattr(local, flag)
        if path:
            assert path in files, f"{where}: --{flag.replace('_', '-')} {path} is not a file of a mounted Secret"
            setattr(local, flag, files[path])
    gate = server_gate(local, worker=args.command == "worker")
    assert gate.tls is not None, where


def test_shared_flags_agree(rendered):
    """Router and workers of one overlay use one Redis and one cache namespace."""
    overlay, objs = rendered
    by_cmd: dict[str, set] = {}
    for _, _, c in kvmesh_containers(objs):
        args = parsed(objs, c)
        if args.command in ("router", "worker"):
            by_cmd.setdefault("redis", set()).add(args.redis_url)
            by_cmd.setdefault("cluster", set()).add(args.cluster)
    for key, values in by_cmd.items():
        assert len(values) == 1, f"{overlay}: router and workers disagree on {key}: {values}"


def test_tenants_are_capped_against_each_other(rendered):
    """The API key Secret holds keys of several tenants (k8s_secrets --tenant A --tenant B):
    every router and worker caps one tenant's Generate calls in flight
    (--max-inflight-per-tenant) at half of what the server takes at once, or less, so one
    tenant's flood leaves the rest to the others. The totals are the servers' own: a router's
    data-plane slots (--max-concurrent-rpcs), a worker's waiting queue (--max-waiting), as
    kvmesh's parser gives them (its defaults where the manifest leaves them out)."""
    from kvmesh.workers.grpc_host import DEFAULT_MAX_CONCURRENT_RPCS

    overlay, objs = rendered
    seen = set()
    for owner, _, c in kvmesh_containers(objs):
        env, argv = resolved(objs, c)
        args = parse_cli(argv, env)
        if args.command == "router":
            total, flag = args.max_concurrent_rpcs, "--max-concurrent-rpcs"
            if flag not in argv:
                assert total == DEFAULT_MAX_CONCURRENT_RPCS
        elif args.command == "worker":
            total, flag = args.max_waiting, "--max-waiting"
        else:
            continue
        seen.add(args.command)
        cap = args.max_inflight_per_tenant
        where = f"{overlay}: {owner}: --max-inflight-per-tenant {cap}"
        assert cap > 0, f"{where}: one tenant may take every slot"
        assert cap < total and 2 * cap <= total, f"{where} leaves other tenants less than half of {flag} {total}"
    if overlay == "ray":
        # router and workers are Ray actors; their --api-keys file is the one the driver
        # generates, for one tenant: no other tenant to keep out. Mounting the kvmesh-api-keys
        # Secret here would need the cap on the actors' command lines too.
        assert not seen, overlay
        assert not any(v.get("secret", {}).get("secretName") == "kvmesh-api-keys"
                       for _, tpl in pod_templates(objs) for v in tpl["spec"].get("volumes", [])), overlay
        return
    assert seen == {"router", "worker"}, f"{overlay}: {seen}"


# -- references between objects ---------------------------------------------------------

def test_services_select_pods_and_ports(rendered):
    overlay, objs = rendered
    templates = pod_templates(objs)
    for svc in find(objs, "Service"):
        sel = svc["spec"]["selector"]
        pods = [tpl for _, tpl in templates if labels_match(sel, tpl["metadata"].get("labels", {}))]
        assert pods, f"{overlay}: Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for tpl in pods:
                cports = [p for c in tpl["spec"]["containers"] for p in c.get("ports", [])]
                assert any(p.get("name") == target or p["containerPort"] == target for p in cports), \
                    f"{overlay}: Service {svc['metadata']['name']} targets port {target} no container has"


def test_workload_selectors_match_templates(rendered):
    overlay, objs = rendered
    for o in objs:
        if o["kind"] in WORKLOAD_KINDS:
            assert labels_match(o["spec"]["selector"]["matchLabels"], o["spec"]["template"]["metadata"]["labels"])
        if o["kind"] == "StatefulSet":
            headless = find(objs, "Service", o["spec"]["serviceName"])
            assert headless, f"{overlay}: StatefulSet {o['metadata']['name']} has no governing Service"


def test_pdb_and_autoscalers_target_workloads(rendered):
    overlay, objs = rendered
    workloads = {(o["kind"], o["metadata"]["name"]): o for o in objs if o["kind"] in WORKLOAD_KINDS}
    for pdb in find(objs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(labels_match(sel, w["spec"]["template"]["metadata"]["labels"]) for w in workloads.values()), \
            f"{overlay}: PDB {pdb['metadata']['name']} selects no workload"
    targets = []
    for hpa in find(objs, "HorizontalPodAutoscaler") + find(objs, "ScaledObject"):
        ref = hpa["spec"]["scaleTargetRef"]
        key = (ref.get("kind", "Deployment"), ref["name"])
        assert key in workloads, f"{overlay}: {hpa['kind']} {hpa['metadata']['name']} targets missing {key}"
        targets.append(key)
    assert len(targets) == len(set(targets)), f"{overlay}: two autoscalers on one workload: {targets}"
    # routers and workers each have a PDB in every overlay that runs them
    for (kind, name), w in workloads.items():
        if name in ("kvmesh-router", "kvmesh-worker"):
            assert any(labels_match(p["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
                       for p in find(objs, "PodDisruptionBudget")), f"{overlay}: no PDB for {name}"
    if ("Deployment", "kvmesh-router") in workloads:
        assert any(h["spec"]["scaleTargetRef"]["name"] == "kvmesh-router" for h in find(objs, "HorizontalPodAutoscaler"))
        assert workloads[("Deployment", "kvmesh-router")]["spec"]["replicas"] >= 2


def ca_key_and_keys(out_dir, data) -> bytes:
    """The CA key and every other generated secret's bytes but the Ray token, joined."""
    return (out_dir / "ca.key").read_bytes() + b"".join(
        v for n, d in data.items() if n != "kvmesh-ray-auth" for v in d.values())


def test_ray_overlay_closes_rays_ports(rendered):
    """Ray without token authentication runs anyone's code, and its actors hold the peer key:
    the Ray pods and the driver run with RAY_AUTH_MODE=token from the Secret, and a policy
    admits Ray's ports only from Ray pods and the driver; others reach only the router."""
    overlay, objs = rendered
    if overlay != "ray":
        return
    for owner, tpl in pod_templates(objs):
        for c in tpl["spec"]["containers"]:
            env = container_env(c, objs, DOWNWARD, OPERATOR_SECRETS)
            assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_AUTH_TOKEN"), owner
    (pol,) = find(objs, "NetworkPolicy")
    nodes = [t for _, t in pod_templates(objs) if t["metadata"]["labels"]["app.kubernetes.io/component"] != "ray-driver"]
    assert nodes and all(labels_match(pol["spec"]["podSelector"]["matchLabels"], t["metadata"]["labels"]) for t in nodes)
    driver = next(t for _, t in pod_templates(objs) if t["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-driver")
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    for rule in pol["spec"]["ingress"]:
        if "from" in rule:  # every peer is a Ray node or the driver
            for peer in rule["from"]:
                sel = peer["podSelector"]["matchLabels"]
                assert "namespaceSelector" not in peer
                assert all(labels_match(sel, t["metadata"]["labels"]) for t in nodes) or \
                    labels_match(sel, driver["metadata"]["labels"])
        else:  # open to any source: the router's port only
            assert [p["port"] for p in rule["ports"]] == ["router"]


def test_network_policies_cover_every_kvmesh_pod(rendered):
    overlay, objs = rendered
    if overlay == "ray":   # Ray's many ports between nodes: test_ray_overlay_closes_rays_ports
        return
    policies = find(objs, "NetworkPolicy")
    for owner, tpl in pod_templates(objs):
        labels = tpl["metadata"]["labels"]
        mine = [p for p in policies if labels_match(p["spec"]["podSelector"].get("matchLabels", {}), labels)]
        types = {t for p in mine for t in p["spec"]["policyTypes"]}
        assert types == {"Ingress", "Egress"}, f"{overlay}: {owner} not closed in both directions"
        cports = {p.get("name") for c in tpl["spec"]["containers"] for p in c.get("ports", [])} | \
                 {p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        for p in mine:
            for rule in p["spec"].get("ingress", []):
                for port in rule.get("ports", []):
                    assert port["port"] in cports, f"{overlay}: {p['metadata']['name']} admits unknown port"


def _allowed(objs, src: str, dst: str, port: int) -> bool:
    """Whether the NetworkPolicies let component ``src`` reach ``dst`` on ``port`` (both ways)."""
    def tpl_of(comp):
        return next(t for _, t in pod_templates(objs) if t["metadata"]["labels"].get("app.kubernetes.io/component") == comp)

    s, d = tpl_of(src), tpl_of(dst)
    dports = {p.get("name"): p["containerPort"] for c in d["spec"]["containers"] for p in c.get("ports", [])}

    def port_ok(rule):
        ps = rule.get("ports")
        return not ps or any(dports.get(p["port"], p["port"]) == port for p in ps)

    def peer_ok(rule, key, other):
        peers = rule.get(key)
        if not peers:
            return True
        return any(labels_match(x.get("podSelector", {}).get("matchLabels", {}), other["metadata"]["labels"])
                   and "namespaceSelector" not in x for x in peers if "podSelector" in x)

    pol = find(objs, "NetworkPolicy")
    eg = any(port_ok(r) and peer_ok(r, "to", d) for p in pol
             if labels_match(p["spec"]["podSelector"]["matchLabels"], s["metadata"]["labels"])
             for r in p["spec"].get("egress", []))
    ing = any(port_ok(r) and peer_ok(r, "from", s) for p in pol
              if labels_match(p["spec"]["podSelector"]["matchLabels"], d["metadata"]["labels"])
              for r in p["spec"].get("ingress", []))
    return eg and ing


def test_network_policy_paths():
    objs = render("cpu")
    assert _allowed(objs, "router", "worker", 50051)
    assert _allowed(objs, "worker", "worker", 50051)       # FetchBlocks
    assert _allowed(objs, "router", "redis", 6379)
    assert _allowed(objs, "worker", "redis", 6379)
    assert not _allowed(objs, "worker", "router", 50050)    # nothing else
    assert not _allowed(objs, "redis", "worker", 50051)
    assert not _allowed(objs, "router", "router", 50050)



def test_no_secret_value_in_any_command_line(rendered):
    """No container's command line, as the kubelet expands it, holds a value from a Secret
    (ps in the pod, or on the node, would show it): Redis' password included."""
    overlay, objs = rendered
    for owner, tpl, c in containers(objs):
        env, argv = resolved(objs, c)
        secret_vars = [i["name"] for i in c.get("env", []) if "secretKeyRef" in i.get("valueFrom", {})]
        for name in secret_vars:
            assert env[name], f"{overlay}: {owner}/{c['name']}: {name} is empty"
            assert not any(env[name] in a for a in argv), f"{overlay}: {owner}/{c['name']}: {name} is in argv"


def _start_redis_container(objs, password: str | None, tmp_path):
    """The kvmesh-redis container's command line, as the kubelet runs it, as a local process
    on a free loopback port (port, bind address and /data are the only changes), with
    REDIS_PASSWORD set to ``password`` (unset for None). Returns (process, port)."""
    import shutil
    import subprocess

    from kvmesh.services.procs import free_port

    assert shutil.which("redis-server"), "redis-server not on PATH (Debian's redis-server, scripts/setup.sh)"
    (c,) = find(objs, "StatefulSet", "kvmesh-redis")[0]["spec"]["template"]["spec"]["containers"]
    env = container_env(c, objs)
    env.pop("REDIS_PASSWORD")
    argv = container_argv(c, {**env, "REDIS_PASSWORD": "<unused>"})
    port = free_port()
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    local = {str(c["ports"][0]["containerPort"]): str(port), "0.0.0.0": "127.0.0.1", "/data": str(data)}
    argv = [local.get(a, a) for a in argv]
    env = {**env, "PATH": os.environ["PATH"], **({"REDIS_PASSWORD": password} if password is not None else {})}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), port


@pytest.mark.parametrize("password", ["kvmesh-dev-only", 'sp ace"quote\\back$(REDIS_PASSWORD)`x`$@#\'end'])
def test_redis_takes_its_password_on_stdin(password, tmp_path):
    """The Redis container requires AUTH with exactly the Secret's password (quoted for
    Redis' config syntax), which is neither in redis-server's argv nor in its environment;
    it keeps the manifest's other options and exits cleanly on SIGTERM."""
    import signal
    import time

    import redis

    proc, port = _start_redis_container(render("cpu"), password, tmp_path)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                redis.Redis(port=port, socket_timeout=2).ping()
                raise AssertionError("redis-server answered without a password")
            except redis.AuthenticationError:
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password=password + "x", socket_timeout=2).ping()
        client = redis.Redis(port=port, password=password, socket_timeout=2, decode_responses=True)
        assert client.ping()
        conf = client.config_get("*")
        assert (conf["maxmemory"], conf["maxmemory-policy"], conf["save"], conf["appendonly"]) == \
            ("1073741824", "noeviction", "", "no")
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:  # sh exec'd redis-server: same pid
            cmdline = fh.read()
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            environ = fh.read()
        assert cmdline.startswith(b"redis-server") and password.encode() not in cmdline
        assert password.encode() not in environ and b"REDIS_PASSWORD=" not in environ
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("password, message", [(None, "has no password"), ("", "has no password"),
                                               ("secret\n", "has a line break")])
def test_redis_refuses_to_start_without_a_usable_password(password, message, tmp_path):
    """An empty password would turn Redis' authentication off; one ending in a newline (a
    Secret made from a file) would not match the clients' URL: the pod stops and says so."""
    proc, _ = _start_redis_container(render("cpu"), password, tmp_path)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1 and message in out, out


# -- overlay specifics and custom resources ---------------------------------------------

def _worker_args(objs):
    sts = find(objs, "StatefulSet", "kvmesh-worker")[0]
    return parsed(objs, sts["spec"]["template"]["spec"]["containers"][0])


def test_cpu_overlay_is_small_and_self_contained():
    objs = render("cpu")
    args = _worker_args(objs)
    assert args.device == "cpu" and args.model is None and args.num_blocks <= 1024 and args.threads == 1
    assert find(objs, "Secret", "kvmesh-redis"), "cpu overlay generates its development Redis password"
    assert find(objs, "StatefulSet", "kvmesh-redis")


def test_gpu_overlay():
    objs = render("gpu")
    args = _worker_args(objs)
    assert args.device == "cuda" and args.model.startswith("/models/")
    assert not find(objs, "Secret"), "the gpu overlay ships no password: the operator creates kvmesh-redis"
    router = find(objs, "Deployment", "kvmesh-router")[0]
    rargs = parsed(objs, router["spec"]["template"]["spec"]["containers"][0])
    assert rargs.model == args.model, "router tokenizes with the workers' model"


def test_external_redis_overlay():
    objs = render("external-redis")
    assert not find(objs, "StatefulSet", "kvmesh-redis") and not find(objs, "Service", "kvmesh-redis")
    args = _worker_args(objs)
    assert args.redis_url == OPERATOR_SECRETS[("kvmesh-redis-url", "url")]


def test_scaled_object():
    objs = render("gpu-keda")
    so = find(objs, "ScaledObject")
    assert len(so) == 1
    spec = so[0]["spec"]
    assert so[0]["apiVersion"] == "keda.sh/v1alpha1"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kvmesh-worker"}
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    trig = spec["triggers"]
    assert trig and all(t["type"] == "prometheus" and t["metadata"]["query"] and
                        float(t["metadata"]["threshold"]) > 0 for t in trig)
    assert "waiting" in trig[0]["metadata"]["query"], "scales on the waiting queue"


def test_ray_cluster():
    import importlib.metadata

    objs = render("ray")
    rc = find(objs, "RayCluster")
    assert len(rc) == 1 and rc[0]["apiVersion"] == "ray.io/v1"
    spec = rc[0]["spec"]
    assert spec["rayVersion"] == importlib.metadata.version("ray"), "RayCluster's Ray must equal the image's"
    head = spec["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"], "CPU head"
    groups = spec["workerGroupSpecs"]
    assert groups and all(g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] for g in groups)
    gpu = [g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert gpu, "a GPU worker group"
    per_pod = int(gpu[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpu[0]["rayStartParams"]["num-gpus"] == str(per_pod)
    driver = find(objs, "Deployment", "kvmesh-ray")[0]
    args = parsed(objs, driver["spec"]["template"]["spec"]["containers"][0])
    assert args.command == "ray" and args.gpus_per_worker == 1 and args.device == "cuda"
    assert args.address == f"ray://{rc[0]['metadata']['name']}-head-svc:10001"
    assert args.workers <= sum(g["maxReplicas"] * per_pod for g in gpu)
    assert driver["spec"]["replicas"] == 1
    router_svc = find(objs, "Service", "kvmesh-router")[0]
    head_ports = head["template"]["spec"]["containers"][0]["ports"]
    assert any(p["containerPort"] == args.router_port and p.get("name") == router_svc["spec"]["ports"][0]["targetPort"]
               for p in head_ports), "the router Service reaches --router-port on the head"


def test_parse_bytes_matches_k8s_sizes():
    """ConfigMap sizes use kvmesh's K/M/G suffixes (powers of 1024), not Kubernetes' Gi."""
    for overlay in ("cpu", "gpu"):
        cm = find(render(overlay), "ConfigMap", "kvmesh-config")[0]["data"]
        for key in ("KVMESH_HOST_BYTES", "KVMESH_DISK_BYTES", "KVMESH_PEER_BYTES"):
            assert parse_bytes(cm[key]) > 0 and not cm[key].endswith("i"), (overlay, key)


def test_k8s_secrets_generator(tmp_path, capsys):
    """`python -m kvmesh.services.k8s_secrets` prints valid Secrets whose certificate names
    kvmesh-peer and the router Service, whose api-keys file accepts the key it kept, and
    keeps the CA key out of the YAML."""
    import yaml
    from cryptography import x509

    from kvmesh.services.auth import Authenticator
    from kvmesh.services.k8s_secrets import main

    out_dir = tmp_path / "creds"
    assert main(["--namespace", "serving", "--tenant", "team-a", "--tenant", "team-b", "--out-dir", str(out_dir),
                 "--days", "2"]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)
    data = {o["metadata"]["name"]: {k: base64.b64decode(v) for k, v in o["data"].items()} for o in objs}
    assert {o["metadata"]["namespace"] for o in objs} == {"serving"}
    assert set(data) == set(GENERATED_SECRETS) and all(set(data[n]) == GENERATED_SECRETS[n] for n in data)
    assert len(data["kvmesh-ray-auth"]["token"]) == 64 and data["kvmesh-ray-auth"]["token"] not in ca_key_and_keys(
        out_dir, data)
    from kvmesh.cache_store.tier_config import record_key_from_file

    key_file = tmp_path / "record.key"
    key_file.write_bytes(data["kvmesh-record-key"]["record.key"])
    assert len(record_key_from_file(str(key_file))) == 32  # a key file the workers accept
    cert = x509.load_pem_x509_certificate(data["kvmesh-tls"]["tls.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"kvmesh-peer", "kvmesh-router", "kvmesh-router.serving.svc"} <= set(names)
    assert data["kvmesh-tls"]["ca.crt"] == (out_dir / "ca.crt").read_bytes()
    ca_key = (out_dir / "ca.key").read_bytes()
    assert b"PRIVATE KEY" in ca_key and oct((out_dir / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert not any(ca_key.strip() in v for d in data.values() for v in d.values()), "the CA key stays offline"
    env = dict(line.split("=", 1) for line in (out_dir / "client.env").read_text().splitlines()
               if line and not line.startswith("#"))
    keys_file = tmp_path / "api-keys"
    keys_file.write_bytes(data["kvmesh-api-keys"]["api-keys"])
    auth = Authenticator.from_file(str(keys_file))
    assert auth.tenant_for(f"Bearer {env['KVMESH_API_KEY']}") == "team-a"
    assert env["KVMESH_API_KEY"].encode() not in data["kvmesh-api-keys"]["api-keys"], "keys are stored hashed"
    assert main(["--tenant", "two words", "--out-dir", str(tmp_path / "x")]) == 2
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for bad in (not_a_folder, not_a_folder / "sub"):  # an error naming the flag, not a traceback
        assert main(["--out-dir", str(bad)]) == 2
        assert "cannot write to --out-dir" in capsys.readouterr().err


def test_k8s_secrets_never_replaces_a_ca_key_without_force(tmp_path, capsys):
    """A second run into the same --out-dir would make a new CA and new API keys and lose the
    old CA key (perhaps its only copy): it exits 2 and leaves the files; --force replaces them."""
    from kvmesh.services.k8s_secrets import main

    out_dir = tmp_path / "creds"
    assert main(["--out-dir", str(out_dir)]) == 0
    first = (out_dir / "ca.key").read_bytes()
    capsys.readouterr()
    assert main(["--tenant", "team-c", "--out-dir", str(out_dir)]) == 2
    assert "already holds ca.key and client.env" in capsys.readouterr().err
    assert (out_dir / "ca.key").read_bytes() == first
    assert main(["--out-dir", str(out_dir), "--force"]) == 0
    assert (out_dir / "ca.key").read_bytes() != first


def test_k8s_secrets_forces_key_modes_and_refuses_links_and_shared_folders(tmp_path, capsys):
    """--force once kept a 0666 file's mode for the new CA key, wrote the key through a
    (dangling) symlink planted as ca.key, and wrote into a folder anyone could write."""
    import os

    from kvmesh.services.k8s_secrets import main

    out_dir = tmp_path / "creds"
    out_dir.mkdir(mode=0o700)
    for name in ("ca.key", "client.env", "ca.crt"):
        (out_dir / name).write_text("old")
        os.chmod(out_dir / name, 0o666)
    assert main(["--out-dir", str(out_dir), "--force"]) == 0
    capsys.readouterr()
    modes = {n: (out_dir / n).stat().st_mode & 0o777 for n in ("ca.key", "client.env", "ca.crt")}
    assert modes == {"ca.key": 0o600, "client.env": 0o600, "ca.crt": 0o644}
    assert b"PRIVATE KEY" in (out_dir / "ca.key").read_bytes()

    elsewhere = tmp_path / "elsewhere.key"
    (out_dir / "ca.key").unlink()
    (out_dir / "ca.key").symlink_to(elsewhere)  # dangling: os.path.exists says False
    for argv in ([], ["--force"]):
        assert main(["--out-dir", str(out_dir), *argv]) == 2
        err = capsys.readouterr().err
        assert "ca.key" in err and "symbolic link" in err and "Remove the link" in err
    assert not elsewhere.exists() and (out_dir / "ca.key").is_symlink()

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert main(["--out-dir", str(shared)]) == 2
    err = capsys.readouterr().err
    assert "writable by others" in err and "chmod 700" in err and not os.listdir(shared)
    os.chmod(shared, 0o770)
    assert main(["--out-dir", str(shared)]) == 2
    assert "writable by its group" in capsys.readouterr().err
    os.chmod(shared, 0o700)
    assert main(["--out-dir", str(shared)]) == 0


def test_credential_files_are_written_with_their_mode_and_never_through_a_link(tmp_path):
    import errno
    import os

    from kvmesh.services.credentials import _write, generate_cluster_credentials

    path = tmp_path / "key"
    path.write_text("old")
    os.chmod(path, 0o666)
    _write(str(path), b"secret", private=True)
    assert path.read_bytes() == b"secret" and path.stat().st_mode & 0o777 == 0o600
    target = tmp_path / "target"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as info:
        _write(str(tmp_path / "link"), b"secret", private=True)
    assert info.value.errno == errno.ELOOP and not target.exists()
    creds = generate_cluster_credentials(str(tmp_path / "run"))  # as `kvmesh up` makes them
    assert os.stat(creds.ca_key).st_mode & 0o777 == 0o600 and os.stat(creds.ca).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("argv", [["--namespace", "Bad NS!"], ["--namespace", ""], ["--dns", "bad name!"]])
def test_k8s_secrets_refuses_names_kubernetes_would_not_take(argv, tmp_path, capsys):
    """These printed YAML with an invalid namespace, or a certificate naming a bad host, and exit 0."""
    from kvmesh.services.k8s_secrets import main

    assert main([*argv, "--out-dir", str(tmp_path / "out")]) == 2
    assert "is not a" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_metrics_ports_admit_the_scraper_of_one_namespace_only(rendered):
    """A metrics rule that admits pods labelled as Prometheus from any namespace admits any
    tenant allowed to create a pod with that label: every peer of a rule on the "metrics"
    port names its namespace."""
    _, objs = rendered
    rules = [rule for pol in find(objs, "NetworkPolicy") for rule in pol["spec"].get("ingress", [])
             if any(p.get("port") == "metrics" for p in rule.get("ports", []))]
    for rule in rules:
        for peer in rule.get("from", [{}]):
            ns = peer.get("namespaceSelector")
            assert ns is None or ns.get("matchLabels") or ns.get("matchExpressions"), peer
    assert rules or not any(p.get("name") == "metrics" for _, t in pod_templates(objs)
                            for c in t["spec"]["containers"] for p in c.get("ports", []))
