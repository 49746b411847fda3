"""``--plot FILE.png``: decode speed per configuration and the acceptance-length histogram.

Left: median decode tokens/s (error bars: min–max over passes), grouped by prompt set and
temperature, one bar per configuration. Right: for every configuration with speculative
counters, the share of verify steps that yielded 1, 2, 3, ... tokens (accepted drafts + the
bonus token), summed over all prompts and passes.

Needs matplotlib (``pip install 'flashdraft[bench]'``); raises ``ImportError`` saying so.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'flashdraft[bench]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    return plt


def _short(prompt_set: str) -> str:
    """A prompt set's label: the file name for a ``.jsonl`` path."""
    return Path(prompt_set).name


def plot(summary: list[dict], path: str | Path, title: str = "") -> None:
    """Write the two-panel figure for ``summary`` (rows of :func:`stats.summarize`) to ``path``."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator
    groups = []
    for s in summary:
        g = (s["prompt_set"], s["temperature"])
        if g not in groups:
            groups.append(g)
    configs = []
    for s in summary:
        if s["config"] not in configs:
            configs.append(s["config"])
    by_key = {(s["prompt_set"], s["temperature"], s["config"]): s for s in summary}

    fig, (ax_speed, ax_hist) = plt.subplots(1, 2, figsize=(14, 5.5))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        xs, ys, lo, hi = [], [], [], []
        for j, g in enumerate(groups):
            s = by_key.get((*g, c))
            tps = s and s["decode_tokens_per_s"]
            if not tps:
                continue
            xs.append(j + (i - (len(configs) - 1) / 2) * width)
            ys.append(tps["median"])
            lo.append(tps["median"] - tps["min"])
            hi.append(tps["max"] - tps["median"])
        ax_speed.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=c, color=f"C{i % 10}")
    ax_speed.set_xticks(range(len(groups)), [f"{_short(p)}\nT={t:g}" for p, t in groups])
    ax_speed.set_ylabel("decode tokens/s (median, min–max)")
    ax_speed.set_title("Decode speed")
    ax_speed.legend(fontsize="small", ncols=2)

    drawn = False
    styles = ("-", "--", ":", "-.")
    for s in summary:
        hist = s.get("accepted_hist")
        if not hist or sum(hist) == 0:
            continue
        total = sum(hist)
        g = groups.index((s["prompt_set"], s["temperature"]))
        label = s["config"] + (f" ({_short(s['prompt_set'])}, T={s['temperature']:g})" if len(groups) > 1 else "")
        # one colour per configuration (as in the bars), one line style per prompt set/temperature
        ax_hist.plot(range(1, len(hist) + 1), [h / total for h in hist], marker="o", label=label,
                     color=f"C{configs.index(s['config']) % 10}", linestyle=styles[g % len(styles)])
        drawn = True
    ax_hist.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.set_xlabel("tokens per verify step (accepted drafts + 1)")
    ax_hist.set_ylabel("share of steps")
    ax_hist.set_title("Acceptance length per step")
    if drawn:
        ax_hist.legend(fontsize="small")
    else:
        ax_hist.text(0.5, 0.5, "no speculative configuration", ha="center", va="center",
                     transform=ax_hist.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
