"""`qwen-rt bench ... --plot PATH`: a bench record drawn as a PNG. Decode tokens/s against batch beside the
memory-bandwidth roofline (the tokens/s at which a step would take only the time to read its bytes), and, for a
GPU record, prefill MFU against prompt length. matplotlib is optional: only --plot needs it."""
from __future__ import annotations

from collections import defaultdict

__all__ = ["plotting_unavailable", "plot_record"]


def plotting_unavailable() -> str | None:
    """Why --plot cannot draw here (None: it can)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def _cpu_series(rec: dict) -> tuple[dict, dict]:
    """(measured, roofline): {label: ([batch], [tok/s])}. qwen_rt per dtype, transformers' best per dtype; the
    roofline per dtype from the weights' bytes (one step reads every weight once) and the measured copy rate."""
    measured: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rec["results"]:
        if r.get("tok_s"):
            label = f"{r['engine']} {r['dtype']}" + (" (best)" if r["engine"] == "transformers" else "")
            measured[label][r["batch"]] = max(measured[label].get(r["batch"], 0.0), r["tok_s"])
    roofline = {}
    bw = rec.get("limits", {}).get("copy_bw")
    batches = sorted({b for points in measured.values() for b in points})
    if bw and batches:
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            if any(dtype in label for label in measured):
                step_bytes = rec["model"]["params"] * size
                roofline[f"roofline {dtype} (copy {bw / 1e9:.0f} GB/s)"] = (batches, [b * bw / step_bytes for b in batches])
    return {k: (sorted(v), [v[b] for b in sorted(v)]) for k, v in measured.items()}, roofline


def _gpu_series(rec: dict) -> tuple[dict, dict]:
    """(measured, roofline) per model: MBU = step bytes / step time / copy rate, so the roofline is tok/s / MBU."""
    measured, roofline = defaultdict(lambda: ([], [])), defaultdict(lambda: ([], []))
    for r in sorted(rec.get("decode", []), key=lambda r: (r["model"], r["batch"])):
        measured[r["model"]][0].append(r["batch"])
        measured[r["model"]][1].append(r["decode_tok_s"])
        if r.get("mbu"):
            roofline[f"{r['model']} roofline"][0].append(r["batch"])
            roofline[f"{r['model']} roofline"][1].append(r["decode_tok_s"] / r["mbu"])
    return dict(measured), dict(roofline)


def plot_record(rec: dict, path: str) -> None:
    """Writes the record's figures to path (PNG)."""
    why = plotting_unavailable()
    if why:
        raise RuntimeError(f"--plot {why}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    is_cpu = rec.get("bench") == "cpu"
    measured, roofline = _cpu_series(rec) if is_cpu else _gpu_series(rec)
    prefill = [] if is_cpu else sorted(rec.get("prefill", []), key=lambda r: r["prompt"])
    if not measured and not prefill:
        raise ValueError("the record has no decode or prefill figures to plot")
    panels = (1 if measured else 0) + (1 if prefill else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    where = f"{rec.get('device') or rec.get('cpu') or rec.get('machine', '')}, commit {rec.get('commit')}, {rec.get('date', '')[:10]}"
    if measured:
        ax = axes.pop(0)
        colours = {}
        for label, (batches, tok_s) in measured.items():
            (line,) = ax.plot(batches, tok_s, "o-", label=label)
            colours[label] = line.get_color()
        for label, (batches, tok_s) in roofline.items():
            # Drawn in the colour of the line it bounds: the same model (GPU) or qwen_rt's line of its dtype (CPU).
            colour = next((c for name, c in colours.items()
                           if label.startswith(name + " ") or name.split()[-1] in label.split()), "grey")
            ax.plot(batches, tok_s, "--", color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("output tokens/s (CPU: whole generate call)" if is_cpu else "decode tokens/s")
        ax.set_title("decode against the memory-bandwidth roofline")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if prefill:
        ax = axes.pop(0)
        ax.plot([r["prompt"] for r in prefill], [r["mfu"] for r in prefill], "o-", label=prefill[0]["model"])
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("MFU (of the measured bf16 matmul rate)")
        ax.set_title("prefill")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"qwen-rt bench {rec.get('bench', 'gpu')}: {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
