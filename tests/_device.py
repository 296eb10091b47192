"""The torch device the engine tests run on.

``KVMESH_TEST_DEVICE`` (default ``cpu``) moves every engine of tests/test_engine.py,
tests/test_engine_tiers.py and tests/test_engine_sharing.py to another device, so the
reuse-against-cold checks run unchanged on a GPU:

    KVMESH_TEST_DEVICE=cuda python -m pytest tests/test_engine.py tests/test_engine_tiers.py \
        tests/test_engine_sharing.py

Asking for a device torch cannot see is an error, not a skip (tests/conftest.py).
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("KVMESH_TEST_DEVICE", "cpu").strip() or "cpu"
