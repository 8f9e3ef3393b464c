"""The project's figures: the benchmarks' measurements drawn with matplotlib (the `plots` extra).

A figure is drawn only from what a run measured, with axes, units, a legend and a title, so a
reader can tell what each mark is without the JSON beside it. matplotlib is imported inside
the drawing functions (Agg, no display, no pyplot state shared between threads): without the
extra a benchmark still prints its JSON, and `write` skips the figure with one warning line.

    timeline_figure(spans)       `bench ttft`: per layer, loading and computing over time
    fanout_figure(fanout)        `bench fleet`: clients done over time, octets out of holder/relay
    ttfl_figure({"moqt": [...]}) `bench load`: the time-to-first-layer distribution per transport
    write(path, figure)          save a PNG; None (and a warning) without matplotlib

Figures go to KVSP_BENCH_OUT when set, else the temporary directory (`out_dir`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOTS_HINT = "pip install 'kvsp-moq[plots]'"
log = logging.getLogger("kvsp.bench.figures")

LOAD_COLOR, COMPUTE_COLOR = "tab:blue", "tab:orange"
#: One colour per transport, the same in every figure.
TRANSPORT_COLORS = {"moqt": "tab:green", "http": "tab:purple"}
TRANSPORT_NAMES = {"moqt": "MOQT through the relay", "http": "HTTP from the holder"}
MiB = 1 << 20


class PlotsUnavailable(ImportError):
    """matplotlib (the `plots` extra) is not installed: figures are skipped, never the run."""


def out_dir() -> Path:
    """Where benchmarks write their figures: KVSP_BENCH_OUT, else the temporary directory."""
    return Path(os.environ.get("KVSP_BENCH_OUT") or tempfile.gettempdir())


def _figure(width: float, height: float, cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure on the Agg canvas with `cols` axes side by side."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotsUnavailable(f"matplotlib is not installed: {PLOTS_HINT}") from e
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, cols, i + 1) for i in range(cols)]
    return fig, axes


def write(path: Path, draw: Callable[..., Figure], *args: Any) -> str | None:
    """Draw `draw(*args)` and save it as a PNG at `path`; its path, or None when matplotlib is
    missing (one warning naming the extra: the run's JSON stays complete without it)."""
    try:
        fig = draw(*args)
    except PlotsUnavailable as e:
        log.warning("figure %s skipped: %s", path.name, e)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return str(path)


# --------------------------------------------------------------------------- bench ttft


def timeline_figure(spans: Sequence[Mapping[str, Any]], title: str | None = None) -> Figure:
    """One pipelined request, per layer: when its KV was loading (upper bar) and when it
    computed (lower bar), in ms from the request's arrival; the overlap is what pipelining
    hides. `spans` is the agent's timeline (`layer`, `load` [start, end], `compute`)."""
    layers = len(spans)
    fig, (ax,) = _figure(10, 1.5 + 0.28 * max(layers, 1))
    loads = [(i, s["load"]) for i, s in enumerate(spans)
             if s.get("load") and s["load"][0] is not None and s["load"][1] is not None]
    computes = [(i, s["compute"]) for i, s in enumerate(spans) if s.get("compute")]
    for i, (a, b) in loads:
        ax.broken_barh([(a, max(b - a, 0.0))], (i - 0.4, 0.4), facecolors=LOAD_COLOR)
    for i, (a, b) in computes:
        ax.broken_barh([(a, max(b - a, 0.0))], (i, 0.4), facecolors=COMPUTE_COLOR)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=LOAD_COLOR, label="loading the layer's cached KV (upper bar of a row)"),
                        Patch(color=COMPUTE_COLOR, label="computing the layer (lower bar of a row)")],
               loc="outside lower center", ncols=2, fontsize="small")
    ax.set_xlabel("time since the request arrived (ms)")
    ax.set_ylabel("layer")
    ax.set_yticks(range(layers), [str(s.get("layer", i)) for i, s in enumerate(spans)])
    ax.set_ylim(layers - 0.5, -0.5)  # layer 0 on top
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "One pipelined request: layer l+1 loads while layer l computes")
    return fig


# --------------------------------------------------------------------------- bench fleet


def fanout_figure(fanout: Mapping[str, Any]) -> Figure:
    """`bench fleet`'s fan-out: left, how many clients had the whole prefix (verified) as time
    went on, per transport and round; right, the octets that left the holder and the relay,
    in copies of the prefix (median over rounds): one copy over MOQT, one per client over HTTP."""
    clients, prefix = fanout["agents"], fanout["block_bytes"]
    fig, (ax, bx) = _figure(12, 4.5, cols=2)
    for transport in ("moqt", "http"):
        runs = fanout[transport]["runs"]
        for r, run in enumerate(runs):
            done = sorted(run["seconds_each"])
            xs, ys = [0.0, *done], list(range(len(done) + 1))
            label = TRANSPORT_NAMES[transport] + (f", round {r + 1}" if len(runs) > 1 else "")
            ax.step(xs, ys, where="post", color=TRANSPORT_COLORS[transport],
                    linestyle="-" if r == 0 else "--", label=label)
    ax.set_xlabel("time since the common start (s)")
    ax.set_ylabel("clients with the whole prefix, verified")
    ax.set_ylim(0, clients + 0.5)
    ax.set_xlim(left=0)
    ax.set_yticks(range(clients + 1))
    ax.grid(alpha=0.3)
    ax.set_title(f"{clients} clients load one {prefix / MiB:g} MiB prefix at once")

    bars = [("holder", "moqt", "holder_egress_bytes"), ("relay", "moqt", "relay_egress_bytes"),
            ("holder", "http", "holder_egress_bytes")]
    bars = [b for b in bars if b[2] in fanout[b[1]]]
    heights = [fanout[t][k] / prefix for _, t, k in bars]
    names = [f"{who}\n({TRANSPORT_NAMES[t].split(' ')[0]})" for who, t, _ in bars]
    drawn = bx.bar(names, heights, color=[TRANSPORT_COLORS[t] for _, t, _ in bars])
    bx.bar_label(drawn, labels=[f"{h:.2f}x" for h in heights])
    bx.axhline(1.0, color="grey", linestyle=":", label="one copy of the prefix")
    bx.axhline(clients, color="black", linestyle=":", label=f"one copy per client ({clients})")
    bx.set_ylim(0, 1.15 * max([*heights, clients]))  # room for the labels above the bars
    bx.set_ylabel("octets sent, in copies of the prefix")
    bx.set_xlabel("interface (transport of the run)")
    bx.set_title("Octets out of each interface (median over rounds)")
    handles = [h for a in (ax, bx) for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize="small")
    return fig


# --------------------------------------------------------------------------- bench load


def ttfl_figure(ttfl_ms: Mapping[str, Sequence[float]], clients: Mapping[str, int] | None = None) -> Figure:
    """`bench load`'s time to the first verified layer, per transport: the share of fetches
    that had their first layer by each time (an empirical CDF), with the p50 and p99 marked."""
    fig, (ax,) = _figure(9, 4.5)
    if not any(ttfl_ms.values()):
        ax.text(0.5, 0.5, "no fetch completed", ha="center", va="center", transform=ax.transAxes)
    for transport, values in ttfl_ms.items():
        if not values:
            continue
        ordered = sorted(values)
        n = len(ordered)
        color = TRANSPORT_COLORS.get(transport)
        who = TRANSPORT_NAMES.get(transport, transport)
        if clients and transport in clients:
            who += f", {clients[transport]} clients"
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", color=color,
                label=f"{who} ({n} fetches)")
        for q, style in ((0.50, "--"), (0.99, ":")):
            x = ordered[min(n - 1, int(q * n))]
            ax.axvline(x, color=color, linestyle=style, alpha=0.7,
                       label=f"{transport.upper()} p{round(q * 100)}: {x:.1f} ms")
    if any(ttfl_ms.values()):
        ax.set_xscale("log")
    ax.set_xlabel("time to the first verified layer (ms, log scale)")
    ax.set_ylabel("share of fetches with their first layer")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    if any(ttfl_ms.values()):
        fig.legend(loc="outside lower center", ncols=2, fontsize="small")
    ax.set_title("Load test: time to first layer, per transport")
    return fig
