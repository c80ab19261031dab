"""What the overlap benchmark's all-to-alls moved, and FP8 dispatch against the model dtype, from the rank files.

Each rank counts its dispatcher's all-to-alls per timed step (:class:`moe.dispatch.Traffic`: calls, rows, bytes of
the token rows, FP8 scales included, and bytes of the routing data sent beside them). Here, per mode and kind of
all-to-all, over every rank and timed step: all-to-alls per rank and step, and bytes per all-to-all (one rank's
share of one collective: what that rank puts in, its own rows included). A mode run with FP8 dispatch
(``<mode>+fp8``, ``python -m bench.overlap --fp8-dispatch``) is set beside its model-dtype twin of the same run:
step time both ways and the ratio of the dispatch-direction bytes, which is ``(D + 4 * ceil(D / 128)) / (2 * D)``
for bf16 rows of width D (0.516 at D = 256 or any multiple of 128).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe.dispatch.traffic import KINDS

__all__ = ["FP8_SUFFIX", "fp8_comparison", "fp8_table", "traffic", "traffic_table"]

FP8_SUFFIX = "+fp8"
"""A mode name with this suffix runs the same schedule with FP8 dispatch."""

DISPATCH_DIRECTION = ("dispatch", "combine_backward")
"""The all-to-alls FP8 dispatch quantizes (forward dispatch, the gradient of combine)."""


def traffic(rank_files: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``{mode: {kind: {per_rank_step, data_bytes, meta_bytes}}}``: all-to-alls per rank and timed step, and the
    mean bytes of token data and of routing data one rank put into one all-to-all, modes in ``--modes`` order.
    Modes without counts (torch's schedule builds its own stages) are left out."""
    sums: dict[str, dict[str, list[int]]] = {}
    steps: dict[str, int] = {}
    for record in rank_files:
        for s in record["steps"]:
            if s["warmup"] or s.get("traffic") is None:
                continue
            steps[s["mode"]] = steps.get(s["mode"], 0) + 1  # one per rank and step
            for kind, t in s["traffic"].items():
                acc = sums.setdefault(s["mode"], {}).setdefault(kind, [0, 0, 0])
                acc[0] += t["calls"]
                acc[1] += t["data_bytes"]
                acc[2] += t["meta_bytes"]
    given = rank_files[0]["options"].get("modes", []) if rank_files else []
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode, kinds in sorted(sums.items(), key=lambda item: given.index(item[0]) if item[0] in given else len(given)):
        out[mode] = {}
        for kind in (k for k in KINDS if k in kinds):
            calls, data, meta = kinds[kind]
            per_step = calls / steps[mode]
            out[mode][kind] = {"per_rank_step": per_step, "data_bytes": data / calls, "meta_bytes": meta / calls}
    return out


def fp8_comparison(step_ms: dict[str, float], counted: dict[str, dict[str, dict[str, float]]]) -> list[dict]:
    """One row per mode run both ways: ``step_ms`` (median per mode) and the dispatch-direction bytes per
    all-to-all with and without FP8 dispatch, and their ratios (FP8 over the model dtype)."""
    rows = []
    for twin, ms_fp8 in step_ms.items():
        base = twin.removesuffix(FP8_SUFFIX)
        if twin == base or base not in step_ms:
            continue
        row = {"mode": base, "step_ms": step_ms[base], "step_ms_fp8": ms_fp8, "step_ratio": ms_fp8 / step_ms[base]}
        for kind in DISPATCH_DIRECTION:
            plain, fp8 = counted.get(base, {}).get(kind), counted.get(twin, {}).get(kind)
            if plain and fp8 and plain["data_bytes"]:
                row[f"{kind}_bytes"] = plain["data_bytes"]
                row[f"{kind}_bytes_fp8"] = fp8["data_bytes"]
                row[f"{kind}_ratio"] = fp8["data_bytes"] / plain["data_bytes"]
        rows.append(row)
    return rows


def _table(header: Sequence[str], cells: list[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def traffic_table(counted: dict[str, dict[str, dict[str, float]]]) -> str:
    """Bytes per all-to-all, per mode and kind (markdown)."""
    cells = [
        [mode, kind, f"{t['per_rank_step']:.0f}", f"{t['data_bytes'] / 1e3:.1f}", f"{t['meta_bytes'] / 1e3:.1f}"]
        for mode, kinds in counted.items()
        for kind, t in kinds.items()
    ]
    return _table(["mode", "all-to-all", "per rank and step", "token kB per a2a", "routing kB per a2a"], cells)


def fp8_table(rows: list[dict]) -> str:
    """FP8 dispatch against the model dtype, per mode run both ways (markdown)."""
    cells = []
    for r in rows:
        ratios = [f"{r[f'{k}_ratio']:.3f}" if f"{k}_ratio" in r else "-" for k in DISPATCH_DIRECTION]
        step = f"{r['step_ms']:.0f} / {r['step_ms_fp8']:.0f} ({r['step_ratio']:.2f}x)"
        cells.append([r["mode"], step, *ratios])
    header = ["mode", "step ms: dtype / FP8 dispatch", "dispatch bytes FP8/dtype", "combine-grad bytes FP8/dtype"]
    return _table(header, cells)
