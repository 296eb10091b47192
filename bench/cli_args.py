"""Checks the benchmark and simulator command lines run before any replay or request.

Each returns a message that names the flag (``--json``, ``--kv-aware``) and says what to
fix, or None; the caller reports it as a usage error (exit status 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from kvmesh.services.cli_checks import can_create_in


def output_file_problem(path: str | os.PathLike, flag: str, make_parents: bool = False) -> str | None:
    """Why ``path`` cannot be written as a file of ``flag``, or None; writes nothing that stays.

    ``make_parents``: the command creates missing folders above the file, so the nearest
    existing one must take new entries; else the file's folder must exist.
    """
    p = Path(path)
    if p.is_dir():
        return f"{flag} {path}: is a folder; give a file name"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{flag} {path}: the file exists and is read-only; pick another path"
    folder = p.resolve().parent
    if make_parents:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.exists():
        return f"{flag} {path}: folder {folder} does not exist; create it first or pick another path"
    if not folder.is_dir():
        return f"{flag} {path}: {folder} is not a folder; pick another path"
    reason = can_create_in(folder)
    if reason:
        return f"{flag} {path}: cannot create a file in {folder} ({reason}); pick a writable folder"
    return None


def output_dir_problem(path: str | os.PathLike, flag: str) -> str | None:
    """Why ``path`` cannot serve as an output folder of ``flag`` (created with its parents
    when missing), or None; writes nothing that stays."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{flag} {path}: a file of that name exists; give a folder (new or existing)"
    folder = p.resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{flag} {path}: {folder} is not a folder; pick another path"
    reason = can_create_in(folder)
    if reason:
        return f"{flag} {path}: cannot write in {folder} ({reason}); pick a writable folder"
    return None


def numeric_kwargs(text: str, flag: str, nullable: tuple[str, ...] = ()) -> dict[str, float | int | None]:
    """A JSON object of numeric constructor arguments (``--kv-aware '{"share_cap": 0.1}'``);
    the keys in ``nullable`` may also be null (None: the argument's "off").

    Raises:
        ValueError: not JSON, not an object, or a value that is not a finite number (NaN,
            Infinity, a string, a bool, null, a list); the message names ``flag`` and the key.
    """
    try:
        kw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON ({exc.msg} at column {exc.colno}); give an object such as "
                         f"'{{\"share_cap\": 0.1}}'") from None
    if not isinstance(kw, dict):
        raise ValueError(f"{flag} takes a JSON object such as '{{\"share_cap\": 0.1}}', got a {type(kw).__name__}")
    for key, value in kw.items():
        if value is None and key in nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{flag}: {key} must be a number, got {json.dumps(value)}")
        if not math.isfinite(value):
            raise ValueError(f"{flag}: {key} must be a finite number, got {value}")
    return kw


# ------------------------------------------------------------------ argparse types
# Each raises argparse.ArgumentTypeError naming the flag; argparse then exits 2 with
# ``argument --flag: MESSAGE``.

def int_at_least(low: int, flag: str, what: str = ""):
    """argparse type: an integer >= ``low`` (``what``: the unit, e.g. "requests")."""
    unit = f" {what}" if what else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= {low}{unit} (got {text!r})") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= {low}{unit} (got {value})")
        return value
    return parse


def float_in(flag: str, low: float, high: float = math.inf, *, low_open: bool = False, allow_inf: bool = False,
             what: str = ""):
    """argparse type: a number in [low, high] (``low_open``: (low, high]); NaN never, inf
    only with ``allow_inf``."""
    bound = (f"> {low:g}" if low_open else f">= {low:g}") + (f" and <= {high:g}" if math.isfinite(high) else "")
    noun = f"a number {bound}" + (f" {what}" if what else "") + (" (or inf)" if allow_inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {noun} (got {text!r})") from None
        ok = not math.isnan(value) and (value > low if low_open else value >= low) and value <= high
        if not ok or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"{flag} must be {noun} (got {text})")
        return value
    return parse


def existing_file(flag: str, what: str = "file"):
    """argparse type: a path to a readable file (``what`` names it in the message)."""
    def parse(text: str) -> str:
        p = Path(text)
        if not p.exists():
            raise argparse.ArgumentTypeError(f"{flag} {text}: no such file (give a {what})")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{flag} {text}: is a folder (give a {what})")
        if not os.access(p, os.R_OK):
            raise argparse.ArgumentTypeError(f"{flag} {text}: cannot read the file (permission denied)")
        return text
    return parse


def output_dir(flag: str):
    """argparse type: a folder the command may create and write in (see `output_dir_problem`)."""
    def parse(text: str) -> str:
        problem = output_dir_problem(text, flag)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text
    return parse


def http_url(flag: str, example: str = "http://127.0.0.1:9100/metrics"):
    """argparse type: an ``http://`` or ``https://`` URL with a host."""
    def parse(text: str) -> str:
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(text)
            port = parts.port  # ValueError for a port that is not a number or out of range
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a valid URL ({exc}); e.g. {example}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not an http:// or https:// URL with a host; "
                                             f"e.g. {example}")
        del port
        return text
    return parse


def target_problem(target: str, api: str = "grpc") -> str | None:
    """What is wrong with a ``kvmesh bench --target`` for ``--api`` (grpc: ``HOST:PORT``;
    openai: ``HOST:PORT`` or an ``http(s)://HOST:PORT[/v1]`` URL), or None."""
    from kvmesh.services.cli_checks import host_port

    if "://" in target:
        if api != "openai":
            return (f"--target {target}: a URL is for the OpenAI-compatible HTTP front; pass --api openai "
                    "with it, or give the gRPC API as HOST:PORT (e.g. 127.0.0.1:50051)")
        try:
            http_url("--target", "http://127.0.0.1:8000/v1")(target)
        except argparse.ArgumentTypeError as exc:
            return str(exc)
        return None
    try:
        host_port(target)
    except argparse.ArgumentTypeError as exc:
        if api == "openai":
            return (f"--target {target!r} is neither HOST:PORT (a port in 1-65535) nor an http(s):// URL; "
                    "e.g. 127.0.0.1:8000 or http://127.0.0.1:8000/v1")
        return f"--target {exc}"
    return None
