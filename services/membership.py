"""Which live workers a router may route to: same model identity, one block size.

A worker whose lease names another ``model_id`` than the router's (different weights,
dtype, config or tokenizer; see `workers.model_identity`) would compute KV under another
namespace and, for text prompts, receive token ids from another tokenizer. A worker with
another ``block_size`` hashes prompts into different blocks. Neither may be mixed in:
`Compatibility.select` routes around them and logs, once per worker and reason, why.

The cluster's block size is the one most live (model-compatible) workers use; on a tie,
the one in use (so a single new worker with another size cannot take the routing from a
warm cluster), else the smallest. A router started without ``--model`` takes the model most workers serve.
Workers may tag the model id with the dtype they compute in (``M+compute=float32``,
`workers.model_identity.kv_model_id`); the router hashes under the tagged id most of the
model's workers advertise and routes around the others.
"""
from __future__ import annotations

import collections
import logging
from typing import NamedTuple

from kvmesh.workers.model_identity import base_model_id

log = logging.getLogger(__name__)


class Selection(NamedTuple):
    """Result of `Compatibility.select`.

    Attributes:
        workers: ``{worker_id: lease}`` of the usable workers (may be empty).
        block_size: their block size (tokens), or 0 when none is usable.
        model_id: the id they hash KV under, compute tag included ("" when none is usable).
        reason: why no worker is usable (empty when some are).
    """

    workers: dict
    block_size: int
    model_id: str
    reason: str


def _most_common(counts: collections.Counter, in_use):
    """The key with the highest count; on a tie ``in_use`` if it is among the tied, else
    the smallest of them."""
    top = max(counts.values())
    tied = sorted(k for k, n in counts.items() if n == top)
    return in_use if in_use in tied else tied[0]


class Compatibility:
    """Filters leases for one router; remembers what it logged so each reason is logged once.

    Args:
        router_model_id: the model id the router hashes and tokenizes for (from its
            ``--model``), or None to follow the workers (router without ``--model``).
    """

    def __init__(self, router_model_id: str | None):
        self.router_model_id = router_model_id
        self._logged: dict[str, str] = {}
        self._in_use: str | None = None  # the tagged id chosen last time (see `select`)
        self._bs_in_use: int | None = None  # the block size chosen last time

    def _note(self, worker_id: str, reason: str) -> None:
        if self._logged.get(worker_id) != reason:
            self._logged[worker_id] = reason
            log.error("not routing to worker %s: %s", worker_id, reason)

    def select(self, live: dict[str, dict]) -> Selection:
        """Usable workers among ``live`` (``{worker_id: lease}``), logging each excluded one."""
        if not live:
            return Selection({}, 0, "", "no live workers registered: start workers or retry")
        models = collections.Counter(str(info.get("model_id", "")) for info in live.values())
        if self.router_model_id:  # the router's checkpoint; workers may tag it with their compute dtype
            tagged = collections.Counter({m: n for m, n in models.items() if base_model_id(m) == self.router_model_id})
            if not tagged:
                model = self.router_model_id
            else:  # the id most workers hash under; on a tie the one in use stays (no flip on a blip)
                model = _most_common(tagged, self._in_use)
            self._in_use = model
        else:
            model = max(sorted(models), key=lambda m: models[m])
        same = {}
        for wid, info in live.items():
            theirs = str(info.get("model_id", ""))
            if theirs == model:
                same[wid] = info
            elif base_model_id(theirs) == base_model_id(model):
                self._note(wid, f"it computes in another dtype ({theirs!r}) than the workers of the model the router "
                                f"uses "
                                f"({model!r}), so its KV differs: start all workers with the same --compute-dtype")
            else:
                self._note(wid, f"it serves model {theirs!r} but the router hashes and tokenizes for {model!r} "
                                f"(weights, dtype, config or tokenizer differ): start both with the same --model")
        if not same:
            return Selection({}, 0, "", f"no live worker serves the router's model {model!r} (workers serve "
                                        f"{sorted(models)}): start the router with the workers' --model")
        sizes = collections.Counter(int(info.get("block_size", 16)) for info in same.values())
        # on a tie the size in use stays: one new misconfigured worker must not take the
        # routing from the warm ones
        block_size = self._bs_in_use = _most_common(sizes, self._bs_in_use)
        usable = {}
        for wid, info in same.items():
            theirs = int(info.get("block_size", 16))
            if theirs != block_size:
                self._note(wid, f"it uses --block-size {theirs} but the cluster's workers use {block_size}: "
                                f"restart it with --block-size {block_size}")
            else:
                usable[wid] = info
                if self._logged.pop(wid, None) is not None:
                    log.info("worker %s is compatible again; routing to it", wid)
        return Selection(usable, block_size, model, "")

    def reason(self, worker_id: str) -> str:
        """Why the last `select` left ``worker_id`` out ("" when it did not, or never saw it)."""
        return self._logged.get(worker_id, "")
