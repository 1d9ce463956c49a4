"""Trace analysis: what `laminar trace summary|plot|export|compare` print and draw.

    from laminar_hpc.analysis import load_run, summarize, format_summary
    run = load_run("runs/qs")                          # every trace file, aligned (live or crashed runs too)
    d = summarize(run, read_metrics("runs/qs"))        # figures as a dict
    print(format_summary(d))
    plot_run(run, rows, "report.png")                  # matplotlib report (Agg)
    export_perfetto(run)                               # Chrome Trace Event Format dict
    print(format_compare(d_a, d_b))

matplotlib is imported only by plot_run.
"""
from __future__ import annotations

from laminar_hpc.analysis.compare import compare, format_compare
from laminar_hpc.analysis.perfetto import export_perfetto, write_perfetto
from laminar_hpc.analysis.trace_summary import format_summary, summarize
from laminar_hpc.analysis.timeline import Timeline, TraceAnalysisError, load_run


def plot_run(*args, **kwargs):
    from laminar_hpc.analysis.plot import plot_run as _plot_run
    return _plot_run(*args, **kwargs)


def summarize_dir(run_dir, **kwargs) -> dict:
    """load_run + metrics.jsonl + summarize, for one run directory."""
    from laminar_hpc.metrics.summary import read_metrics
    return summarize(load_run(run_dir), read_metrics(run_dir), **kwargs)


__all__ = ["Timeline", "TraceAnalysisError", "compare", "export_perfetto", "format_compare", "format_summary",
           "load_run", "plot_run", "summarize", "summarize_dir", "write_perfetto"]
