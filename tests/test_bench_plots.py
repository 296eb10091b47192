"""bench.plots: the three PNG files are valid, non-blank images, also for empty runs."""
from __future__ import annotations

import json
import random
import struct

from kvmesh.bench import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return width, height


def _distinct_colours(path) -> int:
    from matplotlib.image import imread

    img = imread(str(path))
    return len({tuple(px) for px in img.reshape(-1, img.shape[-1])[::97].tolist()})


def _records(seed: int, n: int = 60) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = i * 0.05
        ttft = rng.uniform(5, 200)
        prompt = rng.randint(32, 256)
        out.append({"index": i, "ok": i % 17 != 5, "ttft_ms": ttft, "e2e_ms": ttft + 30, "start_s": start,
                    "end_s": start + (ttft + 30) / 1000, "prompt_tokens": prompt,
                    "cached_tokens": min(prompt, int(prompt * i / n)), "computed_prefill_tokens": prompt // 2,
                    "worker_id": f"worker-{i % 2}", "warmup": i < 3})
    return out


def test_write_plots_makes_valid_pngs(tmp_path):
    paths = plots.write_plots({"round_robin": _records(1), "kv_aware": _records(2)}, tmp_path / "p")
    assert [p.name for p in paths] == list(plots.PLOT_FILES)
    for p in paths:
        w, h = _png_size(p)
        assert w >= 400 and h >= 300
        assert _distinct_colours(p) > 5  # lines and text, not a blank canvas


def test_plots_of_empty_or_failed_runs_still_render(tmp_path):
    failed = [{"index": 0, "ok": False, "code": "UNAVAILABLE"}]
    for p in plots.write_plots({"a": [], "b": failed}, tmp_path):
        _png_size(p)
    for p in plots.write_plots({}, tmp_path / "none"):
        _png_size(p)


def test_plots_main_reads_run_folders(tmp_path, capsys):
    run = tmp_path / "kv_aware"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"policy": "kv_aware"}))
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(3)))
    assert plots.main([str(tmp_path / "out"), str(run)]) == 0
    for name in plots.PLOT_FILES:
        _png_size(tmp_path / "out" / name)
    assert plots.main([str(tmp_path / "out")]) == 2
    assert plots.main([str(tmp_path / "out"), str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err


def test_plots_main_names_the_bad_file_and_line(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "result.json").write_text("[1]")
    (run / "requests.jsonl").write_text("")
    assert plots.main([str(tmp_path / "out"), str(run)]) == 2
    err = capsys.readouterr().err
    assert "result.json" in err and "JSON object" in err
    (run / "result.json").write_text(json.dumps({"policy": "p"}))
    (run / "requests.jsonl").write_text(json.dumps(_records(4, 2)[0]) + "\n{oops\n")
    assert plots.main([str(tmp_path / "out"), str(run)]) == 2
    err = capsys.readouterr().err
    assert "requests.jsonl:2" in err and "not JSON" in err
