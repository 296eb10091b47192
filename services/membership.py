"""Which live workers a router may route to: one model identity, one block size, and
whether text prompts may go to them.

A worker's lease names the ``model_id`` it hashes KV under (weights, dtype, config and
tokenizer; see `workers.model_identity`) and the ``tokenizer_id`` of the files that decide
its token ids (`model_identity.tokenizer_fingerprint`: no weights). Workers of two model ids
compute KV under two namespaces and may not be mixed behind one decision; a worker with
another ``block_size`` hashes prompts into different blocks. `Compatibility.select` routes
around them and logs, once per worker and reason, why.

The router tokenizes text (and chat) prompts itself, so it sends text only to workers whose
tokenizer is its own: equal ``tokenizer_id``. A lease without one (a worker older than the
field, or of another recipe version) is compared by its ``model_id`` with the router's own
checkpoint id, which the router then computes once by hashing every weight file
(`Selection.needs_model_id`), as it used to at start; a router whose ``--model`` folder
holds no weight files cannot, and sends such workers token ids only. Token-id prompts need
no tokenizer.

Which model: a router with ``--model`` routes to the workers that share its tokenizer, and
among those, when they serve several checkpoints, to its own checkpoint's if its id is
known; else the model most of them serve. When no worker shares its tokenizer it routes
token-id prompts to the model most workers serve and refuses text (`Selection.text_reason`).
A router without ``--model`` (the built-in byte tokenizer) takes the model most workers
serve. Workers may tag the model id with the dtype they compute in (``M+compute=float32``,
`workers.model_identity.kv_model_id`); the router hashes under the tagged id most of the
model's workers advertise and routes around the others. On a tie the model in use stays
(no flip on a blip).

The cluster's block size is the one most live (model-compatible) workers use; on a tie,
the one in use (so a single new worker with another size cannot take the routing from a
warm cluster), else the smallest.
"""
from __future__ import annotations

import collections
import logging
from typing import NamedTuple

from kvmesh.workers.model_identity import base_model_id, comparable_tokenizer_id

log = logging.getLogger(__name__)


class Selection(NamedTuple):
    """Result of `Compatibility.select`.

    Attributes:
        workers: ``{worker_id: lease}`` of the usable workers (may be empty).
        block_size: their block size (tokens), or 0 when none is usable.
        model_id: the id they hash KV under, compute tag included ("" when none is usable).
        reason: why no worker is usable (empty when some are).
        text_reason: why text prompts may not go to them (what to fix), empty when they may:
            the router's tokenizer is not theirs, or not known to be.
        needs_model_id: the router's checkpoint id would change this selection and is not
            known yet: compute it (`Compatibility.router_model_id`) and select again.
    """

    workers: dict
    block_size: int
    model_id: str
    reason: str
    text_reason: str = ""
    needs_model_id: bool = False


def _most_common(counts: collections.Counter, in_use):
    """The key with the highest count; on a tie ``in_use`` if it is among the tied, else
    the smallest of them."""
    top = max(counts.values())
    tied = sorted(k for k, n in counts.items() if n == top)
    return in_use if in_use in tied else tied[0]


class Compatibility:
    """Filters leases for one router; remembers what it logged so each reason is logged once.

    Args:
        router_model_id: the router's checkpoint id (``"<dir>@<fingerprint>"``, as workers
            name it without compute tag) when known, else None. The router computes it only
            when a selection needs it (`Selection.needs_model_id`) and then sets this
            attribute; `model_id_pending` says whether it still may.
        tokenizer_id: the router's `model_identity.tokenizer_fingerprint`, or None to compare
            every worker by model id.
        own_model: the router was given ``--model``: prefer workers of its tokenizer (and
            checkpoint). Default: whether either id is given.
        router_name: how messages name the router's model (default ``router_model_id``).
    """

    def __init__(self, router_model_id: str | None, tokenizer_id: str | None = None,
                 own_model: bool | None = None, router_name: str | None = None):
        self.router_model_id = router_model_id
        self.tokenizer_id = tokenizer_id
        self.own_model = own_model if own_model is not None else (router_model_id is not None
                                                                  or tokenizer_id is not None)
        self.router_name = router_name or repr(router_model_id)
        #: True while ``router_model_id`` is unknown but may still be computed
        self.model_id_pending = False
        #: why ``router_model_id`` could not be computed ("" when it was not tried or worked)
        self.model_id_problem = ""
        #: ``router_model_id`` could not be computed because the router's folder holds no
        #: weight files (config and tokenizer only): nothing to compare older leases with
        self.model_id_weightless = False
        self._logged: dict[str, str] = {}
        self._text_logged = ""
        self._in_use: str | None = None  # the tagged id chosen last time (see `select`)
        self._bs_in_use: int | None = None  # the block size chosen last time

    def _note(self, worker_id: str, reason: str) -> None:
        if self._logged.get(worker_id) != reason:
            self._logged[worker_id] = reason
            log.error("not routing to worker %s: %s", worker_id, reason)

    def speaks(self, lease: dict) -> bool | None:
        """Whether the worker of ``lease`` turns text into the token ids the router does: by
        ``tokenizer_id`` when both have one of this recipe, else by its checkpoint id against
        the router's; None when that is not known (yet)."""
        theirs = lease.get("tokenizer_id")
        if comparable_tokenizer_id(self.tokenizer_id) and comparable_tokenizer_id(theirs):
            return theirs == self.tokenizer_id
        if self.router_model_id is not None:
            return base_model_id(str(lease.get("model_id", ""))) == self.router_model_id
        return None

    def select(self, live: dict[str, dict]) -> Selection:
        """Usable workers among ``live`` (``{worker_id: lease}``), logging each excluded one."""
        if not live:
            return Selection({}, 0, "", "no live workers registered: start workers or retry")
        model_of = {wid: str(info.get("model_id", "")) for wid, info in live.items()}
        models = collections.Counter(model_of.values())
        speaks = {wid: self.speaks(info) for wid, info in live.items()}
        # a lease that does not say (an older worker) shares the tokenizer of a lease of its
        # model id that does: equal model ids mean equal config and tokenizer files
        # (`model_identity.IDENTITY_FILES`)
        model_speaks = {m: True for wid, m in model_of.items() if speaks[wid]}
        for wid, m in model_of.items():
            if speaks[wid] is None:
                speaks[wid] = model_speaks.get(m)
        needs = False
        text_first = False  # only workers of the router's tokenizer may be used
        if self.own_model:
            ok = collections.Counter(m for wid, m in model_of.items() if speaks[wid])
            # the router's checkpoint id would decide: a worker that does not say which
            # tokenizer it uses, or a choice between checkpoints of the router's tokenizer
            needs = self.model_id_pending and (None in speaks.values() or len({base_model_id(m) for m in ok}) > 1)
            if ok:
                text_first = True
                if self.router_model_id is not None:  # several checkpoints of its tokenizer: its own
                    own = collections.Counter({m: n for m, n in ok.items() if base_model_id(m) == self.router_model_id})
                    ok = own or ok
                model = _most_common(ok, self._in_use)
            else:  # none takes the router's text (or not known yet): token ids still can go
                model = _most_common(models, self._in_use)
            self._in_use = model
        else:
            model = max(sorted(models), key=lambda m: models[m])
        same = {}
        for wid, info in live.items():
            theirs = model_of[wid]
            if theirs == model:
                if text_first and not speaks[wid]:
                    self._note(wid, f"it serves model {theirs!r} with another tokenizer than the router's (config.json "
                                    f"or tokenizer files differ from {self.router_name}'s): start both with the same "
                                    f"--model")
                else:
                    same[wid] = info
            elif base_model_id(theirs) == base_model_id(model):
                self._note(wid, f"it computes in another dtype ({theirs!r}) than the workers of the model the router "
                                f"uses "
                                f"({model!r}), so its KV differs: start all workers with the same --compute-dtype")
            elif speaks[wid] is False:
                self._note(wid, f"it serves model {theirs!r} but the router hashes and tokenizes for {model!r} "
                                f"(weights, dtype, config or tokenizer differ): start both with the same --model")
            elif speaks[wid] is None:
                self._note(wid, f"it serves model {theirs!r}, publishes no tokenizer id (an older kvmesh), and the "
                                f"router routes to {model!r}: start all workers with the same --model")
            else:
                self._note(wid, f"it serves model {theirs!r} but the router routes to the workers of {model!r} "
                                f"(another checkpoint of the same tokenizer): start all workers with the same --model")
        if not same:
            return Selection({}, 0, "", f"no live worker serves the router's model {model!r} (workers serve "
                                        f"{sorted(models)}): start the router with the workers' --model",
                             needs_model_id=needs)
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
        return Selection(usable, block_size, model, "", self._text_reason(model, [speaks[w] for w in usable]),
                         needs)

    def _text_reason(self, model: str, speaks: list) -> str:
        """Why text may not go to workers of ``model`` whose `speaks` are ``speaks`` ("" when
        it may), logged once per change. What is returned goes to clients: it names the kind
        of problem and what to do, never the router's folder nor an error of its filesystem,
        which the log line carries."""
        waiting = False  # for the router's checkpoint id: not worth an error line
        detail = ""  # what only the log says
        if all(speaks):
            why = ""
        elif False in speaks:
            mine = "its --model folder" if self.own_model else self.router_name  # a path stays in the log
            why = (f"the router tokenizes for {mine} but the workers serving {model!r} use another tokenizer "
                   f"(config.json or tokenizer files differ): send token_ids, or have the operator start the "
                   f"router with --model pointing at the workers' model directory")
            detail = f"the router tokenizes for {self.router_name}"
        elif self.model_id_pending:
            waiting = True
            why = (f"the workers serving {model!r} do not publish their tokenizer id (an older kvmesh) and the "
                   f"router is still hashing its checkpoint to compare model ids: retry in a moment, or send "
                   f"token_ids")
        elif self.model_id_weightless:
            why = (f"the workers serving {model!r} do not publish their tokenizer id (an older kvmesh) and the "
                   f"router's --model folder has no weight files (*.safetensors) to compute the checkpoint id "
                   f"they are compared by: send token_ids; the operator may upgrade those workers (they then "
                   f"publish their tokenizer id) or give the router the full checkpoint (see the router's log)")
            detail = f"the router's folder is {self.router_name}"
        else:
            why = (f"the workers serving {model!r} do not publish their tokenizer id (an older kvmesh) and the "
                   f"router could not read its own checkpoint to compare model ids: send token_ids; the operator "
                   f"should check the router's log (upgrade the workers, or make the router's --model folder "
                   f"and its weights readable)")
            detail = f"{self.router_name}: {self.model_id_problem or 'no id'}"
        if why != self._text_logged:
            self._text_logged = why
            if why and not waiting:
                log.error("text prompts refused: %s%s", why, f" ({detail})" if detail else "")
        return why

    def reason(self, worker_id: str) -> str:
        """Why the last `select` left ``worker_id`` out ("" when it did not, or never saw it)."""
        return self._logged.get(worker_id, "")
