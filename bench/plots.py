"""PNG plots of bench runs (matplotlib, Agg canvas; no display needed).

Each function takes ``runs``: a mapping from a label (the routing policy) to that run's
per-request records (see `bench.report`), warm-up records left out by the caller, and
writes one PNG:

- `ttft_cdf`: empirical CDF of client-side TTFT (ms), one line per run.
- `hit_rate_over_time`: prefix-cache token hit rate of the requests finishing in each
  time bin (`bench.report.hit_rate_series`), one line per run.
- `worker_load`: time-averaged requests in flight on each worker, one panel per run,
  with each worker's share of requests and of computed prefill tokens in the legend.

``python -m kvmesh.bench.plots OUT_DIR RUN_DIR [RUN_DIR ...]`` redraws them from the
``requests.jsonl`` files of earlier runs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Mapping, Sequence

from kvmesh.bench import report

#: File names `write_plots` produces.
PLOT_FILES = ("ttft_cdf.png", "hit_rate_over_time.png", "worker_load.png")


def _figure(width: float = 7.5, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _measured(records: Sequence[dict]) -> list[dict]:
    return [r for r in records if not r.get("warmup")]


def ttft_cdf(runs: Mapping[str, Sequence[dict]], path: str | Path) -> Path:
    """Empirical CDF of TTFT (ms) of the successful requests of each run."""
    fig = _figure()
    ax = fig.add_subplot()
    lo = hi = None
    failed_runs = []
    for label, records in runs.items():
        measured = _measured(records)
        errors = sum(1 for r in measured if not r.get("ok") and not r.get("cancelled"))
        xs, ys = report.ecdf(r["ttft_ms"] for r in measured if r.get("ok") and r.get("ttft_ms") is not None)
        if errors:
            failed_runs.append(f"{label}: {errors} of {len(measured)} requests failed")
        if not xs:
            continue
        p50 = report.percentiles(xs, [50])[0]
        err = f", {errors} failed" if errors else ""
        ax.step(xs, ys, where="post", label=f"{label} (p50 {p50:,.1f} ms, n={len(xs)}{err})")
        lo = xs[0] if lo is None else min(lo, xs[0])
        hi = xs[-1] if hi is None else max(hi, xs[-1])
    if lo is not None and lo > 0 and hi / lo > 50:
        ax.set_xscale("log")
    ax.set_xlabel("TTFT, ms (client side)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("Time to first token, CDF")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)
    if failed_runs:  # failed requests have no TTFT: say how many the curves leave out
        ax.text(0.01, 0.99, "\n".join(failed_runs), ha="left", va="top", fontsize=8, color="tab:red",
                transform=ax.transAxes)
    return _save(fig, path)


def _bins(records: Sequence[dict], most: int) -> int:
    # About five finished requests per bin at least, so one request does not make a bin.
    return max(1, min(most, sum(1 for r in records if r.get("ok")) // 5))


def hit_rate_over_time(runs: Mapping[str, Sequence[dict]], path: str | Path, num_bins: int = 20) -> Path:
    """Token hit rate (%) over time per run: per time bin (solid) and cumulative (dashed).

    At most ``num_bins`` bins, fewer for short runs (about five requests per bin).
    """
    fig = _figure()
    ax = fig.add_subplot()
    for label, records in runs.items():
        measured = _measured(records)
        series = [p for p in report.hit_rate_series(measured, _bins(measured, num_bins))
                  if p["hit_rate_tokens"] is not None]
        if not series:
            continue
        (line,) = ax.plot([p["t_s"] for p in series], [100.0 * p["hit_rate_tokens"] for p in series], marker="o",
                          markersize=3, label=f"{label}, per bin")
        ax.plot([p["t_s"] for p in series], [100.0 * p["cumulative_hit_rate_tokens"] for p in series],
                linestyle="--", color=line.get_color(), alpha=0.8, label=f"{label}, cumulative")
    ax.set_xlabel("time since the start of the run, s (bin end)")
    ax.set_ylabel("prefix-cache hit rate, % of prompt tokens")
    ax.set_ylim(0, 100)
    ax.set_title("Hit rate over time")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def worker_load(runs: Mapping[str, Sequence[dict]], path: str | Path, num_bins: int = 40) -> Path:
    """Time-averaged requests in flight per worker (`bench.report.load_series`); one panel per run."""
    from matplotlib.ticker import MaxNLocator

    n = max(1, len(runs))
    fig = _figure(7.5, 2.4 * n + 0.6)
    for i, (label, records) in enumerate(runs.items() or [("(none)", [])]):
        ax = fig.add_subplot(n, 1, i + 1)
        measured = _measured(records)
        load = report.worker_load(measured)
        total_req = sum(d["requests"] for d in load.values()) or 1
        total_pre = sum(d["computed_prefill_tokens"] for d in load.values()) or 1
        top = 0.0
        for wid, points in report.load_series(measured, num_bins).items():
            d = load.get(wid, {"requests": 0, "computed_prefill_tokens": 0})
            ax.plot([t for t, _ in points], [v for _, v in points], marker=".", markersize=3,
                    label=f"{wid}: {100 * d['requests'] / total_req:.0f}% of requests, "
                          f"{100 * d['computed_prefill_tokens'] / total_pre:.0f}% of prefill")
            top = max([top] + [v for _, v in points])
        ax.set_title(f"{label}: requests in flight per worker (time average per bin)", fontsize=10)
        ax.set_ylabel("in flight")
        ax.set_ylim(0, max(1.0, top) * 1.45)  # head room for the legend
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="upper right", fontsize=7, ncol=2 if len(ax.lines) > 2 else 1)
        else:
            ax.text(0.5, 0.5, "no requests with a known worker", ha="center", va="center", transform=ax.transAxes)
        if i == n - 1:
            ax.set_xlabel("time since the start of the run, s")
    return _save(fig, path)


def write_plots(runs: Mapping[str, Sequence[dict]], out_dir: str | Path) -> list[Path]:
    """All three plots into ``out_dir`` (names in `PLOT_FILES`); returns their paths."""
    out_dir = Path(out_dir)
    return [ttft_cdf(runs, out_dir / PLOT_FILES[0]), hit_rate_over_time(runs, out_dir / PLOT_FILES[1]),
            worker_load(runs, out_dir / PLOT_FILES[2])]


def load_records(run_dir: str | Path) -> tuple[str, list[dict]]:
    """(policy, records) of a run folder: its result.json and requests.jsonl.

    Raises:
        OSError: a file is missing or unreadable.
        ValueError: a file is not what `bench.harness` writes (not JSON, or not objects);
            the message names the file and, for requests.jsonl, the line.
    """
    run_dir = Path(run_dir)
    path = run_dir / "result.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: expected a JSON object (a harness run's result.json), got {type(result).__name__}")
    path = run_dir / "requests.jsonl"
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected one JSON object per line, got {type(record).__name__}")
        records.append(record)
    return str(result.get("policy") or run_dir.name), records


def unique_labels(labels: Sequence[str], run_dirs: Sequence[str | Path]) -> list[str]:
    """``labels`` with each repeated one made unique by its run folder ("kv_aware (runs/a)"),
    then by its position if the folders repeat too; unique labels stay as they are."""
    out = list(labels)
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            out[i] = f"{label} ({run_dirs[i]})"
    for i, label in enumerate(out):
        if out.count(label) > 1:
            out[i] = f"{label} #{i + 1}"
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m kvmesh.bench.plots OUT_DIR RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    try:
        loaded = [load_records(d) for d in args[1:]]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labels = [label for label, _ in loaded]
    unique = unique_labels(labels, args[1:])
    if unique != labels:
        print("warning: runs share a label; plotting them as " + ", ".join(repr(u) for u in unique),
              file=sys.stderr)
    runs = {label: records for label, (_, records) in zip(unique, loaded)}
    for p in write_plots(runs, args[0]):
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
