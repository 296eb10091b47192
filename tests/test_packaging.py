"""The installed package lives under one `kvmesh` namespace: no generic top-level names."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERIC = ("services", "workers", "proto", "bench", "cache_store")


def test_every_installed_package_is_under_kvmesh():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["packages"], "no packages listed"
    assert all(p.startswith("kvmesh.") for p in cfg["packages"]), cfg["packages"]
    # every mapped folder exists in the repository
    for name, folder in cfg["package-dir"].items():
        assert (ROOT / folder).is_dir(), (name, folder)
    assert cfg["package-dir"]["kvmesh.services"] == "services"


def test_outside_the_repository_only_kvmesh_is_importable(tmp_path):
    code = ("import importlib.util as u, json; "
            f"print(json.dumps({{n: u.find_spec(n) is not None for n in {GENERIC!r}}})); "
            "import kvmesh.services.cli, kvmesh.cache_store.hashing, kvmesh.proto.kvmesh_pb2; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    found, ok = res.stdout.strip().splitlines()
    assert ok == "ok"
    assert "true" not in found, f"generic top-level package importable outside the repo: {found}"
