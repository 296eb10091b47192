"""The container image's steps, without a container daemon (none on these machines).

The Dockerfile is parsed: its install steps must go through scripts/setup.sh with options
the script accepts, every file it copies must exist and survive .dockerignore, it runs as
the non-root user the k8s/ manifests expect, and `kvmesh` is the entrypoint. Then the
build stage's copy of the source tree is rebuilt in a temporary folder and packaged, so a
module the COPY lines miss fails here, not in a registry.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from tests._k8s import ROOT, container_argv, pod_templates, render

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in open(DOCKERFILE):
        s = line.rstrip("\n")
        if not buf and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (ARGs before the first FROM under "")."""
    res: dict[str, list] = {"": []}
    cur = ""
    for ins, args in instructions():
        if ins == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", args, re.I)
            cur = m.group(2) or m.group(1)
            res[cur] = [("FROM", m.group(1))]
        else:
            res[cur].append((ins, args))
    return res


def dockerignore() -> list[str]:
    pats = []
    for line in open(os.path.join(ROOT, ".dockerignore")):
        line = line.strip()
        if line and not line.startswith("#"):
            pats.append(line.rstrip("/"))
    return pats


def ignored(path: str, pats: list[str]) -> bool:
    parts = path.split("/")
    for pat in pats:
        bare = pat.removeprefix("**/")
        for i in range(len(parts)):
            if fnmatch.fnmatch("/".join(parts[: i + 1]), pat) or fnmatch.fnmatch(parts[i], bare) and pat.startswith("**/"):
                return True
    return False


def copies(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    out = []
    for ins, args in stage:
        if ins == "COPY" and "--from=" not in args:
            *srcs, dst = args.split()
            out.append((srcs, dst))
    return out


def test_stages_and_flavors():
    st = stages()
    args = dict(a.split("=", 1) for i, a in st[""] if i == "ARG" and "=" in a)
    assert args["FLAVOR"] == "cpu", "CPU is the default flavor"
    assert "cuda" in args["CUDA_BASE"] and {"base-cpu", "base-cuda", "build", "runtime"} <= set(st)
    assert st["build"][0] == ("FROM", "base-${FLAVOR}") and st["runtime"][0] == ("FROM", "base-${FLAVOR}")
    # multi-stage: the runtime stage takes the virtualenv from the build stage, nothing else
    from_build = [a for i, a in st["runtime"] if i == "COPY" and "--from=build" in a]
    assert from_build == ["--from=build /opt/kvmesh/.venv /opt/kvmesh/.venv"]
    # torch: CPU wheel for cpu, PyPI's CUDA wheel for cuda; both the version pinned in pyproject
    pinned = next(d for d in tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]
                  if d.startswith("torch"))
    for flavor in ("base-cpu", "base-cuda"):
        env = " ".join(a for i, a in st[flavor] if i == "ENV")
        spec = re.search(r'TORCH_SPEC="([^"]+)"', env).group(1)
        assert spec.split("+")[0] == pinned, f"{flavor}: {spec} vs pyproject {pinned}"


def test_installs_only_through_setup_script():
    st = stages()
    runs = [(name, a) for name, ins in st.items() for i, a in ins if i == "RUN"]
    assert runs
    for name, cmd in runs:
        assert "./scripts/setup.sh" in cmd, f"{name}: RUN must call scripts/setup.sh: {cmd}"
        assert not re.search(r"\b(apt-get|apt|pip|pip3)\s+install\b", cmd), f"{name}: installs outside setup.sh"
    script = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    accepted = set(re.findall(r"^\s+(--[a-z-]+)\)", script, re.M))
    for _, cmd in runs:
        for opt in re.findall(r"setup\.sh((?:\s+--[a-z-]+)*)", cmd)[0].split():
            assert opt in accepted, f"setup.sh does not accept {opt} (accepts {sorted(accepted)})"
    assert any("--runtime" in c and "--apt-only" not in c for n, c in runs if n == "build")
    assert any("--runtime --apt-only" in c for n, c in runs if n == "runtime")


def test_setup_script_rejects_unknown_option():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--no-such-option"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--no-such-option" in out.stderr


def test_copied_files_exist_and_are_not_ignored():
    pats = dockerignore()
    for stage in ("build", "runtime"):
        for srcs, _ in copies(stages()[stage]):
            for src in srcs:
                path = os.path.join(ROOT, src)
                assert os.path.exists(path), f"COPY {src}: not in the repository"
                assert not ignored(src.rstrip("/"), pats), f"COPY {src}: excluded by .dockerignore"
    assert ignored(".venv", pats) and ignored(".git", pats) and ignored("cache_store/__pycache__", pats)


def test_user_and_entrypoint_match_the_manifests():
    rt = stages()["runtime"]
    user = next(a for i, a in rt if i == "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot needs a number)"
    assert json.loads(next(a for i, a in rt if i == "ENTRYPOINT")) == ["kvmesh"]
    scripts = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
    assert "kvmesh" in scripts
    for overlay in ("cpu", "gpu", "ray"):
        for _, tpl in pod_templates(render(overlay)):
            sec = tpl["spec"]["securityContext"]
            if tpl["spec"]["containers"][0]["image"].startswith("kvmesh"):
                assert (sec["runAsUser"], sec["runAsGroup"]) == (int(uid), int(gid)), overlay
                for c in tpl["spec"]["containers"]:
                    argv = container_argv(c, {})
                    assert not argv or argv[0] == "kvmesh", f"{overlay}: runs {argv[0]}, not the entrypoint"
    exposed = {int(p) for i, a in rt if i == "EXPOSE" for p in a.split()}
    assert {50050, 50051} <= exposed


@pytest.mark.slow
def test_build_stage_source_packages_every_module(tmp_path):
    """Lay out what the build stage copies, build the wheel from it, and compare modules."""
    ctx = tmp_path / "ctx"
    pats = dockerignore()
    for srcs, dst in copies(stages()["build"]):
        for src in srcs:
            path = os.path.join(ROOT, src)
            if os.path.isdir(path):   # Docker copies a directory's contents into dst
                shutil.copytree(path, ctx / dst, dirs_exist_ok=True,
                                ignore=lambda d, names: [n for n in names
                                                         if ignored(os.path.relpath(os.path.join(d, n), ROOT), pats)])
            else:
                target = ctx / dst / os.path.basename(src) if dst.endswith("/") else ctx / dst
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(ctx)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kvmesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("cache_store", "workers", "services", "proto", "bench"):
        for f in os.listdir(os.path.join(ROOT, pkg)):
            if f.endswith(".py"):
                assert f"kvmesh/{pkg}/{f}" in names, f"the image would lack kvmesh/{pkg}/{f}"
    assert "kvmesh/bench/data/mooncake_conversation_sample.jsonl" in names
    assert any(n.endswith("entry_points.txt") for n in names)
