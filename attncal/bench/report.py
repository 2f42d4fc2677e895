"""Bench output: results.json, a markdown table and two PNG plots, written atomically."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ..artifact import commit_dir
from .harness import Row, rows_to_dicts


def markdown_table(rows: list[Row]) -> str:
    head = ("| engine | batch | seq | p50 ms | p95 ms | seq/s | tok/s | peak MiB | lat/ort | lat/torch | mem/ort "
            "| lat/peer | mem/peer |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    lines = [head]
    for r in sorted(rows, key=lambda r: (r.batch, r.seq, r.engine)):
        lines.append(
            f"| {r.engine} | {r.batch} | {r.seq} | {r.p50_ms:.1f} | {r.p95_ms:.1f} | {r.seq_per_s:.2f} | "
            f"{r.tok_per_s:.0f} | {f(r.peak_mib, '.1f')} | {f(r.latency_vs_ort, '.3f')} | "
            f"{f(r.latency_vs_torch, '.3f')} | {f(r.memory_vs_ort, '.3f')} | {f(r.latency_vs_peer, '.3f')} | "
            f"{f(r.memory_vs_peer, '.3f')} |"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path, value: str, ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for e in sorted({r.engine for r in rows}):
            pts = sorted((r.seq, getattr(r, value)) for r in rows if r.engine == e and r.batch == b
                         and getattr(r, value) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, batch {b}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_results(out: Path, rows: list[Row], meta: dict, notes: dict[str, str]) -> Path:
    """Write results.json, results.md, latency.png and memory.png into `out` (replacing it)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "results.json").write_text(json.dumps({"meta": meta, "notes": notes, "rows": rows_to_dicts(rows)},
                                                     indent=2))
        md = [f"# attncal bench: {meta.get('model_name', meta.get('model'))}", "",
              f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
              f"{meta['machine']['threads']} threads; "
              + ", ".join(f"{k} {v}" for k, v in meta["machine"]["versions"].items()), "",
              f"Config: {meta['config']}", ""]
        if meta.get("pooled"):
            md += [f"Pooling of ort-pooled / ort-opt-pooled: {meta['pooled']}; seq counts content tokens, "
                   "their rows carry the landmarks besides, up to the max length, where landmarks replace content",
                   ""]
        if meta.get("peer"):
            md += [f"Peer (lat/peer, mem/peer): `{meta['peer']}`, the uncalibrated graph this model would otherwise "
                   "run: ONNX Runtime's optimized graph where its optimizer fuses the attention, else the plain "
                   "export.", ""]
        md += [markdown_table(rows), ""]
        if meta.get("memory_probes"):
            md += [f"Peak MiB: the median of {meta['memory_probes']} fresh processes per engine and shape (each "
                   "probe in results.json, `peak_mib_probes`).", ""]
        for e, why in notes.items():
            md.append(f"* `{e}` skipped: {why}")
        (tmp / "results.md").write_text("\n".join(md) + "\n")
        _plot(rows, tmp / "latency.png", "p50_ms", "p50 latency per batch (ms)", "latency")
        if any(r.peak_mib is not None for r in rows):
            _plot(rows, tmp / "memory.png", "peak_mib", "peak working memory (MiB)", "memory")
        tmp.chmod(0o755)
        commit_dir(tmp, out)  # the old results stay until the new ones are complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
