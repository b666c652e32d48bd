"""The benchmark's figures, drawn with matplotlib from a results dict (`benchmark.run_benchmark` or its saved JSON).

Each function writes one PNG and returns its path, or None when the run has nothing to draw. No torch needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .settings import ADAPTIVE_SETTING, column_name, setting_order


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install 'modeling-xpress[bench]'") from error
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _finish_axes(ax, xlabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt, fig, path: Path) -> Path:
    """Lay out, write and close a figure; returns its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tau_vs_k(results: Mapping, path: Path) -> Path | None:
    """Paper Fig. 3: τ vs K per dataset (columns) and temperature (rows), adaptive as a separate point, Markov and
    no-head methods as dashed horizontal baselines."""
    summary = results["summary"]
    if not summary["sweep"]:
        return None
    plt = _pyplot()
    datasets, temps = list(results["datasets"]), results["settings"]["temperatures"]
    fig, axes = plt.subplots(len(temps), len(datasets), figsize=(4.5 * len(datasets), 3.4 * len(temps)),
                             squeeze=False, sharey=True)  # fmt: skip
    ks = sorted({setting_order(r["setting"])[1] for r in summary["sweep"] if r["setting"] != ADAPTIVE_SETTING})
    adaptive_x = (max(ks) if ks else 0) + 1
    baselines = {m: v["refiner"] for m, v in results["methods"].items() if v["refiner"] != "xpress"}
    tau = {(r["method"], r["dataset"], r["temperature"]): r["tau"] for r in summary["tau"]}
    for i, temperature in enumerate(temps):
        for j, dataset in enumerate(datasets):
            ax = axes[i][j]
            rows = [r for r in summary["sweep"] if r["dataset"] == dataset and r["temperature"] == temperature]
            for method in sorted({r["method"] for r in rows}):
                fixed = sorted((setting_order(r["setting"])[1], r["tau"]) for r in rows
                               if r["method"] == method and r["setting"] != ADAPTIVE_SETTING)  # fmt: skip
                line = ax.plot([k for k, _ in fixed], [t for _, t in fixed], "o-", label=f"{method} (fixed K)")[0]
                adaptive = [r["tau"] for r in rows if r["method"] == method and r["setting"] == ADAPTIVE_SETTING]
                if adaptive:
                    ax.plot([adaptive_x], adaptive, "*", ms=12, color=line.get_color(), label=f"{method} adaptive")
            for c, (method, refiner) in enumerate(baselines.items()):
                value = tau.get((method, dataset, temperature))
                if value is not None:
                    ax.axhline(value, ls="--", color=f"C{c + 3}", label=f"{method} ({refiner})")
            ax.set_xticks(ks + [adaptive_x], [str(k) for k in ks] + ["adapt."])
            ax.set_title(column_name(dataset, temperature))
            ax.set_xlabel("Jacobi iterations K")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("τ (tokens / verification)")
    axes[0][-1].legend(fontsize=8)
    return _save(plt, fig, path)


def plot_training_curves(stages: Mapping[str, list[dict]], path: Path) -> Path | None:
    """Training curves of several stages (name → a Trainer's `log_history`): the τ estimate on the training batches
    and on the held-out evaluation (left), the loss (right), against the step. None when nothing was logged."""
    stages = {name: history for name, history in stages.items() if any("loss" in e for e in history)}
    if not stages:
        return None
    plt = _pyplot()
    fig, (tau_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c, (name, history) in enumerate(stages.items()):
        train = [(e["step"], e) for e in history if "loss" in e]
        evals = [(e["step"], e) for e in history if "eval_loss" in e]
        tau_ax.plot([s for s, e in train if "tau_estimate" in e], [e["tau_estimate"] for _, e in train
                    if "tau_estimate" in e], color=f"C{c}", alpha=0.35, lw=0.8)  # fmt: skip
        if evals:
            tau_ax.plot([s for s, _ in evals], [e["eval_tau_estimate"] for _, e in evals], "o-", color=f"C{c}",
                        label=f"{name} (held-out)")  # fmt: skip
        loss_ax.plot([s for s, _ in train], [e["loss"] for _, e in train], color=f"C{c}", alpha=0.5, lw=0.8,
                     label=f"{name} (train)")  # fmt: skip
        if evals:
            loss_ax.plot([s for s, _ in evals], [e["eval_loss"] for _, e in evals], "o-", color=f"C{c}",
                         label=f"{name} (held-out)")  # fmt: skip
    tau_ax.set_ylabel("τ estimate at T=1 (faint: training batches)")
    loss_ax.set_ylabel("objective")
    for ax in (tau_ax, loss_ax):
        _finish_axes(ax, "step")
    return _save(plt, fig, path)


def plot_draft_breakdown(results: Mapping, path: Path) -> Path:
    """Paper Fig. 4: stacked per-block draft cost (drafter forward / lm_head readout / refiner) per method."""
    plt = _pyplot()
    rows = results["summary"]["breakdown"]
    labels = [f"{r['method']}\nT={r['temperature']:g}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 1.5), 3.8))
    bottom = [0.0] * len(rows)
    for part in ("drafter", "lm_head", "refiner"):
        values = [r[f"{part}_ms_per_block"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per drafted block")
    ax.set_title("Draft-step latency breakdown (spec_generate timers)")
    ax.legend()
    return _save(plt, fig, path)


def plot_refiner_latency(results: Mapping, path: Path) -> Path | None:
    """Paper Table 3 as a plot: xPress refine latency vs K (median, p10–p90 bars), Markov serial decode and the plain
    argmax as horizontal lines."""
    rows = results["summary"]["latency"]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    fixed_ks = sorted({setting_order(r["setting"])[1] for r in rows
                       if r["refiner"] == "xpress" and r["setting"] != ADAPTIVE_SETTING})  # fmt: skip
    adaptive_x = (max(fixed_ks) if fixed_ks else 0) + 1
    for method in dict.fromkeys(r["method"] for r in rows if r["refiner"] == "xpress"):
        fixed = [(setting_order(r["setting"])[1], r) for r in rows
                 if r["method"] == method and r["setting"] != ADAPTIVE_SETTING]  # fmt: skip
        fixed.sort(key=lambda pair: pair[0])
        xs, ys = [k for k, _ in fixed], [r["median_us"] for _, r in fixed]
        err = [[r["median_us"] - r["p10_us"] for _, r in fixed], [r["p90_us"] - r["median_us"] for _, r in fixed]]
        line = ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=f"{method} (K passes)")[0]
        for r in rows:
            if r["method"] == method and r["setting"] == ADAPTIVE_SETTING:
                ax.plot([adaptive_x], [r["median_us"]], "*", ms=12, color=line.get_color(), label=f"{method} adaptive")
    for c, r in enumerate(r for r in rows if r["refiner"] != "xpress"):
        ax.axhline(r["median_us"], ls="--" if r["refiner"] == "markov" else ":", color=f"C{c + 3}",
                   label=f"{r['method']} ({r['setting']})")  # fmt: skip
    if fixed_ks:
        ax.set_xticks(fixed_ks + [adaptive_x], [str(k) for k in fixed_ks] + ["adapt."])
    ax.set_ylabel("µs per block (median)")
    ax.set_title("Refinement latency per block")
    _finish_axes(ax, "Jacobi iterations K")
    return _save(plt, fig, path)


__all__ = ["plot_draft_breakdown", "plot_refiner_latency", "plot_tau_vs_k", "plot_training_curves"]
