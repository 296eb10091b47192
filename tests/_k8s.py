"""Rendering the k8s/ overlays and reading what the kubelet would run, for the tests.

`render` runs `kubectl kustomize` (Debian's kubectl, installed by scripts/setup.sh);
`container_argv` expands a container's command line the way the kubelet does: variables
from ``envFrom`` ConfigMaps, then ``env`` in order, ``$(NAME)`` references to variables
defined before, ``$$`` for a literal ``$``; unknown references stay as written.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "k8s")
OVERLAYS = sorted(d for d in os.listdir(os.path.join(K8S, "overlays"))
                  if os.path.isfile(os.path.join(K8S, "overlays", d, "kustomization.yaml")))
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kubectl() -> str:
    exe = shutil.which("kubectl")
    assert exe, "kubectl not on PATH: run scripts/setup.sh (installs Debian's kubernetes-client)"
    return exe


def render(overlay: str) -> list[dict]:
    """The objects `kubectl kustomize k8s/overlays/OVERLAY` prints (empty documents dropped)."""
    out = subprocess.run([kubectl(), "kustomize", os.path.join(K8S, "overlays", overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed: {out.stderr}"
    # kustomize warns of fields it will drop (bases, patchesStrategicMerge, ...): none may be used
    assert "deprecated" not in out.stderr, f"kubectl kustomize {overlay} warns: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    """(owner name, pod template) for every Deployment, StatefulSet and RayCluster group."""
    out = []
    for o in objs:
        if o["kind"] in WORKLOAD_KINDS:
            out.append((o["metadata"]["name"], o["spec"]["template"]))
        elif o["kind"] == "RayCluster":
            out.append((o["metadata"]["name"] + "/head", o["spec"]["headGroupSpec"]["template"]))
            for g in o["spec"].get("workerGroupSpecs", []):
                out.append((o["metadata"]["name"] + "/" + g["groupName"], g["template"]))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion of ``text`` with ``env``."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, objs: list[dict], downward: dict[str, str] | None = None,
                  operator_secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The environment the kubelet gives ``container``.

    ``downward`` maps fieldRef paths (``status.podIP``) to values; ``operator_secrets``
    gives {(secret, key): value} for Secrets the operator creates. A reference to a
    ConfigMap or Secret that is neither rendered nor given raises AssertionError.
    """
    downward = downward or {}
    operator_secrets = operator_secrets or {}
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        assert ref, f"only configMapRef envFrom is used, got {src}"
        cms = find(objs, "ConfigMap", ref["name"])
        assert cms, f"envFrom ConfigMap {ref['name']} is not in the rendered overlay"
        env.update({k: str(v) for k, v in cms[0].get("data", {}).items()})
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        vf = item["valueFrom"]
        if "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            env[name] = downward.get(path, f"<{path}>")
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            secrets = find(objs, "Secret", ref["name"])
            if secrets:
                data = secrets[0].get("data", {})
                assert ref["key"] in data, f"Secret {ref['name']} has no key {ref['key']}"
                env[name] = base64.b64decode(data[ref["key"]]).decode()
            else:
                key = (ref["name"], ref["key"])
                assert key in operator_secrets, f"Secret {ref['name']} is neither rendered nor operator-supplied"
                env[name] = operator_secrets[key]
        elif "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            env[name] = str(find(objs, "ConfigMap", ref["name"])[0]["data"][ref["key"]])
        elif "resourceFieldRef" in vf:
            env[name] = downward.get(vf["resourceFieldRef"]["resource"], "<resource>")
        else:
            raise AssertionError(f"unhandled valueFrom {vf}")
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with $(NAME) expanded (what the container's process receives)."""
    return [expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]]


def parse_quantity(q) -> float:
    """A Kubernetes quantity ("512Mi", "2G", "500m", 4) as a number (bytes or cores)."""
    s = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "m": 1e-3}
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * units[suffix]
    return float(s)


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
