"""What a benchmark run's raw records say: every summary table, the model card's rows and the Markdown report. The
labels the records carry (entries, run settings) are defined in `settings.py`.

Everything here is a pure function of the results dict that `benchmark.run_benchmark` returns (or of its saved JSON),
and this module imports no torch: summaries and reports are plain Python over the raw records.

τ is pooled: committed tokens / target verifications over all steps of a group; the per-prompt means are in
the raw records. Speed is a ratio of tokens/s measured in the same run; absolute seconds are raw data only.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence

from .settings import (
    COMPILED_PLAIN,
    COMPILED_SPEC,
    CONFIG_SETTING,
    ENTRIES,
    PLAIN,
    column_name,
    setting_order,
)

ALL = "all"  # the pooled pseudo-dataset in summary rows


# ---------------------------------------------------------------------------------------------------------------------
# Summaries (pure functions of the raw results)
# ---------------------------------------------------------------------------------------------------------------------


def _pooled(records: Sequence[dict]) -> dict:
    """Pool the generation stats of several records."""
    lengths = [t for r in records for t in r["stats"]["acceptance_lengths"]]
    iterations = [i for r in records for i in r["stats"]["jacobi_iterations"]]
    blocks = max(len(iterations), 1)
    timer = {k: sum(r["stats"][f"time_{k}"] for r in records) for k in ("drafter", "lm_head", "refiner", "verify")}
    taus = [r["stats"]["mean_tau"] for r in records if r["stats"]["acceptance_lengths"]]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        # Mean of per-prompt τ over prompts that drafted at all (a prompt ended by EOS at once has no τ).
        "tau_prompt_mean": statistics.fmean(taus) if taus else None,
        "verifications": len(lengths),
        "blocks": len(iterations),
        "mean_jacobi_iterations": sum(iterations) / len(iterations) if iterations else None,
        "drafter_ms_per_block": 1e3 * timer["drafter"] / blocks,
        "lm_head_ms_per_block": 1e3 * timer["lm_head"] / blocks,
        "refiner_ms_per_block": 1e3 * timer["refiner"] / blocks,
        "verify_ms_per_step": 1e3 * timer["verify"] / max(len(lengths), 1),
        "prompts": len(records),
    }


def _groups(records: Sequence[dict], fields: Sequence[str], pool_datasets: bool = True) -> dict[tuple, list[dict]]:
    """Group records by the values of `fields`; with `pool_datasets` every record also joins the group whose
    "dataset" is ALL."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[f] for f in fields)].append(r)
        if pool_datasets:
            groups[tuple(ALL if f == "dataset" else r[f] for f in fields)].append(r)
    return groups


def _stat_rows(records: Sequence[dict], fields: Sequence[str], pool_datasets: bool = True) -> list[dict]:
    """One row per group: the grouping fields and the pooled generation stats."""
    return [dict(zip(fields, key)) | _pooled(group) for key, group in _groups(records, fields, pool_datasets).items()]


def _rate(records: Sequence[dict]) -> float:
    return sum(r["new_tokens"] for r in records) / sum(r["seconds"] for r in records)


def _throughput_rows(records: Sequence[dict]) -> list[dict]:
    """tokens/s of each entry over tokens/s of plain eager generate (`speedup`) and, when the run measured it, of the
    compiled plain baseline (`speedup_vs_compiled`), per dataset and temperature (and pooled). The compiled baseline
    has a row of its own (method None) against the eager one."""
    rows = []
    groups = _groups(records, ("dataset", "temperature", "entry", "method"))
    for (dataset, temperature, entry, method), group in groups.items():
        if entry == PLAIN:
            continue
        plain_rate = _rate(groups[(dataset, temperature, PLAIN, None)])
        compiled = groups.get((dataset, temperature, COMPILED_PLAIN, None))
        compiled_rate = _rate(compiled) if compiled else None
        rate = _rate(group)
        rows.append({
            "method": method, "entry": entry, "dataset": dataset, "temperature": temperature,
            "tokens_per_s": rate, "plain_tokens_per_s": plain_rate, "speedup": rate / plain_rate,
            "compiled_plain_tokens_per_s": compiled_rate,
            "speedup_vs_compiled": rate / compiled_rate if compiled_rate else None,
            "tau": _pooled(group)["tau"] if entry != COMPILED_PLAIN else None, "prompts": len(group),
        })  # fmt: skip
    return rows


def _latency_rows(latency: Mapping[str, dict]) -> list[dict]:
    rows = []
    for method, entry in latency.items():
        for result in entry["results"]:
            s = sorted(result["seconds"])
            q = statistics.quantiles(s, n=10) if len(s) > 1 else [s[0]] * 9
            rows.append({
                "method": method, "refiner": result["refiner"], "setting": result["setting"],
                "median_us": 1e6 * statistics.median(s), "p10_us": 1e6 * q[0], "p90_us": 1e6 * q[-1],
                "samples": len(s), "blocks": entry["blocks"],
            })  # fmt: skip
    return rows


def summarize(results: Mapping) -> dict:
    """Every table of the report, derived from `results["records"]` and `results["latency"]` only."""
    records = results["records"]
    main = [r for r in records if r["setting"] == CONFIG_SETTING]  # the checkpoints as saved
    plain = [r for r in records if r["entry"] in (PLAIN, COMPILED_PLAIN)]
    # τ and the timers: from spec_generate, or from its compiled twin (same τ) for a method and temperature measured
    # through that one alone (a run with --entries spec_generate_compiled, or several runs joined).
    eager = {(r["method"], r["temperature"]) for r in main if r["entry"] == "spec_generate"}
    spec = [r for r in main if r["entry"] == "spec_generate"
            or (r["entry"] == COMPILED_SPEC and (r["method"], r["temperature"]) not in eager)]  # fmt: skip
    sweep = [r for r in records if r["entry"] == "spec_generate" and r["setting"] not in (None, CONFIG_SETTING)]
    greedy = [r for r in records if r["identical_to_plain"] is not None]
    fields = ("method", "entry", "setting", "dataset")
    identity = [
        dict(zip(fields, key), identical=sum(r["identical_to_plain"] for r in group), prompts=len(group))
        for key, group in _groups(greedy, fields).items()
    ]
    return {
        "tau": _stat_rows(spec, ("method", "dataset", "temperature")),
        "tau_from_compiled": any(r["entry"] == COMPILED_SPEC for r in spec),  # some τ had no eager entry to come from
        "sweep": _stat_rows(sweep, ("method", "dataset", "temperature", "setting")),
        "throughput": _throughput_rows(main + plain),
        "identity": identity,
        "breakdown": _stat_rows(spec, ("method", "temperature"), pool_datasets=False),
        "latency": _latency_rows(results.get("latency", {})),
    }


def card_rows(summary: Mapping) -> list[dict]:
    """Rows for `cards.render_model_card(config, results=...)`: τ and the speed ratios per method (against eager plain
    decoding, and `_vs_compiled` against compiled plain decoding), pooled dataset included."""
    speed = {(r["method"], r["entry"], r["dataset"], r["temperature"]): r["speedup"] for r in summary["throughput"]}
    compiled = {(r["method"], r["entry"], r["dataset"], r["temperature"]): r["speedup_vs_compiled"]
                for r in summary["throughput"]}  # fmt: skip
    rows = []
    for r in summary["tau"]:
        key = (r["method"], r["dataset"], r["temperature"])
        row = {"method": r["method"], "dataset": r["dataset"], "temperature": r["temperature"], "tau": r["tau"],
               "speedup_spec_generate": speed.get((key[0], "spec_generate", *key[1:])),
               "speedup_generate": speed.get((key[0], "generate", *key[1:])),
               "speedup_spec_generate_vs_compiled": compiled.get((key[0], "spec_generate", *key[1:]))}  # fmt: skip
        if (key[0], COMPILED_SPEC, *key[1:]) in speed:  # columns of the compiled entry when the run measured it
            row["speedup_spec_generate_compiled"] = speed[(key[0], COMPILED_SPEC, *key[1:])]
            row["speedup_spec_generate_compiled_vs_compiled"] = compiled[(key[0], COMPILED_SPEC, *key[1:])]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Markdown report
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]


def _columns(results: Mapping) -> list[tuple[str, float]]:
    """(dataset, temperature) columns in run order, pooled dataset last."""
    datasets = list(results["datasets"]) + [ALL]
    return [(d, t) for t in results["settings"]["temperatures"] for d in datasets]


def _identity_order(key: tuple) -> tuple:
    method, entry, setting = key  # the compiled plain baseline: (None, COMPILED_PLAIN, None), listed first
    return ("", entry, (-1, 0)) if method is None else (method, entry, setting_order(setting))


def _draft_cap_text(cap, *, chosen: bool) -> str:
    """", at most 3 drafts verified per block"; with a cap per loop ("auto": {"eager": 3, "compiled": 5}) each loop's."""
    if not cap:
        return ""
    if isinstance(cap, Mapping):
        cap = " / ".join(f"{n} ({loop})" for loop, n in cap.items())
    return f", at most {cap} drafts verified per block" + (" (chosen on this machine)" if chosen else "")


def markdown_report(results: Mapping, plots: Mapping[str, str] | None = None) -> str:
    """The README-ready report: settings, then one table per measurement, then the plots (relative paths)."""
    s, summary, cols = results["settings"], results["summary"], _columns(results)
    env = results["environment"]
    temps = ", ".join(f"{t:g}" for t in s["temperatures"])
    dirty = " (with uncommitted changes)" if env["git_dirty"] else ""
    counts = ", ".join(f"{d} {v['prompts']}" for d, v in results["datasets"].items())
    methods = ", ".join(
        f"`{m}` ({v['refiner']}, block {v['block_size']}, K≤{v['jacobi_max_iters']}"
        + (", early exit" if v["jacobi_early_exit"] else "")
        + _draft_cap_text(v.get("num_assistant_tokens"), chosen=s.get("num_assistant_tokens") == "auto")
        + ")"
        for m, v in results["methods"].items()
    )
    lines = [
        f"# Benchmark `{results.get('run_name', '')}`",
        "",
        f"Target `{env['target_model']}` in {env['target_dtype']} on {env['device']} "
        f"({env['cpu'] or env['cuda_device']}, "
        f"{env['torch_threads']} torch threads); torch {env['torch']}, transformers {env['transformers']}, "
        f"commit `{env['git_commit']}`{dirty}. Started {results['started_utc']}, "
        f"wall time {results['wall_time_s']:.0f} s.",
        "",
        f"Prompts per dataset: {counts} "
        f"(limit {s['limit']}); at most {s['max_new_tokens']} new tokens; temperatures {temps}; "
        f"seed {s['seed']}. Methods: {methods}.",
        "",
        "τ = tokens committed per target verification (bonus included), pooled over all steps; speed = tokens/s "
        "over plain `target.generate` tokens/s measured side by side in this run.",
        "",
        "## Mean acceptance length τ (`spec_generate`, checkpoint settings)",
        "",
    ]  # fmt: skip
    if summary.get("tau_from_compiled"):  # absent from summaries saved before it existed
        lines += ["Where the run measured no eager `spec_generate`, τ is that of `spec_generate(compile=True)`.", ""]
    tau = {(r["method"], r["dataset"], r["temperature"]): r["tau"] for r in summary["tau"]}
    lines += _table(["method"] + [column_name(*c) for c in cols],
                    [[m] + [_fmt(tau.get((m, *c))) for c in cols] for m in results["methods"]])  # fmt: skip

    if summary["sweep"]:
        lines += ["", "## Jacobi sweep: τ (mean iterations to settle) per K", "",
                  "Fixed K runs K passes (early exit off); the iteration count is the passes until the block stopped "
                  "changing (≤ K). Adaptive: K = block_size − 1 with early exit, so the count is the passes run.",
                  ""]  # fmt: skip
        sweep = {(r["method"], r["setting"], r["dataset"], r["temperature"]): r for r in summary["sweep"]}
        labels = sorted({r["setting"] for r in summary["sweep"]}, key=setting_order)
        for method in sorted({r["method"] for r in summary["sweep"]}):
            rows = []
            for label in labels:
                cells = [sweep.get((method, label, *c)) for c in cols]
                rows.append([label] + [f"{_fmt(r['tau'])} ({_fmt(r['mean_jacobi_iterations'], 1)})" if r else "–"
                                       for r in cells])  # fmt: skip
            lines += [f"`{method}`:", ""] + _table(["K"] + [column_name(*c) for c in cols], rows) + [""]

    lines += ["", "## End-to-end speed ratio against plain `target.generate` (same run)", ""]
    speed = {(r["method"], r["entry"], r["dataset"], r["temperature"]): r for r in summary["throughput"]}
    entries = [e for e in ENTRIES if any(r["entry"] == e for r in summary["throughput"])]
    has_compiled = any(r["entry"] == COMPILED_PLAIN for r in summary["throughput"])
    rows = [[m, e] + [f"{_fmt(speed[(m, e, *c)]['speedup'])}×" if (m, e, *c) in speed else "–" for c in cols]
            for m in results["methods"] for e in entries]  # fmt: skip
    if has_compiled:
        rows.insert(0, ["plain (static cache + torch.compile)", "generate"]
                    + [f"{_fmt(speed[(None, COMPILED_PLAIN, *c)]['speedup'])}×" for c in cols])  # fmt: skip
    lines += _table(["method", "entry"] + [column_name(*c) for c in cols], rows)
    if has_compiled:
        warm = results.get("warm_up", {})
        first = warm.get("compiled_plain_first_call_s")
        lines += ["", "## End-to-end speed ratio against compiled plain decoding (static cache + `torch.compile`, "
                  "same run)", "",
                  "The baseline a user of this device would pick instead. Its first call compiled for "
                  f"{_fmt(first, 1)} s (not counted in any ratio).", ""]  # fmt: skip
        lines += _table(["method", "entry"] + [column_name(*c) for c in cols],
                        [[m, e] + [f"{_fmt(speed[(m, e, *c)]['speedup_vs_compiled'])}×" if (m, e, *c) in speed
                                   else "–" for c in cols]
                         for m in results["methods"] for e in entries])  # fmt: skip

    if summary["identity"]:
        datasets = list(results["datasets"]) + [ALL]
        ident = {(r["method"], r["entry"], r["setting"], r["dataset"]): r for r in summary["identity"]}
        keys = sorted({(r["method"], r["entry"], r["setting"]) for r in summary["identity"]}, key=_identity_order)
        lines += ["", "## Greedy identity: outputs equal to the target's greedy output, token for token (T=0)", ""]
        counts = {key: f"{r['identical']}/{r['prompts']}" for key, r in ident.items()}
        lines += _table(["method", "entry", "setting"] + datasets,
                        [[k[0] or "plain", k[1], k[2] or "–"] + [counts.get((*k, d), "–") for d in datasets]
                         for k in keys])  # fmt: skip

    lines += ["", "## Draft step per block (ms, `spec_generate` timers, all datasets)", ""]
    lines += _table(["method", "T", "drafter", "lm_head", "refiner", "verify / step", "blocks"],
                    [[r["method"], _fmt(r["temperature"], 0), _fmt(r["drafter_ms_per_block"], 3),
                      _fmt(r["lm_head_ms_per_block"], 3), _fmt(r["refiner_ms_per_block"], 3),
                      _fmt(r["verify_ms_per_step"], 3), r["blocks"]] for r in summary["breakdown"]])  # fmt: skip

    if summary["latency"]:
        lines += ["", "## Refinement latency per block (µs, median [p10–p90] of `refine` on real drafter outputs)",
                  "",
                  "xPress fixed K: early exit off. Markov: its serial decode. none: the argmax of the drafter's "
                  "marginals.", ""]  # fmt: skip
        lines += _table(["method", "head", "setting", "median", "p10–p90", "samples"],
                        [[r["method"], r["refiner"], r["setting"], _fmt(r["median_us"], 0),
                          f"{_fmt(r['p10_us'], 0)}–{_fmt(r['p90_us'], 0)}", r["samples"]]
                         for r in summary["latency"]])  # fmt: skip
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


__all__ = [
    "ALL",
    "card_rows",
    "markdown_report",
    "summarize",
]
