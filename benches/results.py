"""What every bench writes beside its printed table, and the plots drawn from it.

Each bench takes `--out DIR` (default benches/results) and `--plot`, and at the end of a run
calls `save`, which writes:
  - DIR/<name>.json: the bench, its parameters, the machine (host name, CPU model, cores,
    memory, GPUs), the commit (`git rev-parse --short HEAD`, and whether the tree had
    uncommitted changes), the date, and every figure of its table as `rows` (a list of dicts);
    further tables under `tables`, and whatever else the bench hands over (raw runs, series);
  - DIR/<name>.csv: the table's rows, and DIR/<name>-<table>.csv for each further table;
  - DIR/<name>.png with --plot: drawn from the JSON alone, so a saved run can be drawn again:

    .venv/bin/python benches/results.py --plot benches/results/<name>.json [--png PATH]

The plots live here (not in the benches) so that drawing needs matplotlib only, not torch,
h5py or the client.
"""

import argparse
import csv
import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results"


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options every bench shares: where its figures go, and whether to draw them."""
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="where <bench>.json and <bench>.csv (and .png) go (default: benches/results)")
    parser.add_argument("--plot", action="store_true", help="draw <bench>.png from the JSON (matplotlib)")


# ---------------------------------------------------------------------------------------------
# The machine and the tree.


def _first(path: str, key: str):
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == key:
                    return v.strip()
    except OSError:
        pass
    return None


def _git(*argv):
    try:
        out = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine() -> dict:
    """What the figures were measured on."""
    mem = _first("/proc/meminfo", "MemTotal")  # "24548720 kB"
    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            gpus = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {
        "node": platform.node(),
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "gpus": gpus,
        "system": platform.platform(),
        "python": platform.python_version(),
    }


def source() -> dict:
    """The commit the run was made at, and whether tracked files differed from it."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    # A copy of the tree whose .git may not be current (a GPU machine's) names its commit in
    # LARDER_COMMIT.
    if os.environ.get("LARDER_COMMIT"):
        return {"commit": os.environ["LARDER_COMMIT"], "dirty": None}
    return {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": bool(status) if status is not None else None}


def params(args) -> dict:
    """The run's options, as JSON values (--out and --plot left out: where, not what)."""
    out = {}
    for k, v in vars(args).items():
        if k in ("out", "plot") or v is None:
            continue
        out[k] = v if isinstance(v, (bool, int, float, str, list)) else str(v)
    return out


# ---------------------------------------------------------------------------------------------
# Writing.


def _cell(v):
    return json.dumps(v) if isinstance(v, (list, dict)) else v


def write_csv(path: pathlib.Path, rows: list) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(v) for k, v in r.items()})


def dumps(v, level: int = 0) -> str:
    """JSON with the top two levels of objects spread over lines and each row of a table on a
    line of its own: readable, and a long series (the soak's readings) stays compact."""
    pad = " " * (level + 1)
    end = "\n" + " " * level
    if isinstance(v, dict) and v and level < 2:
        return "{\n" + ",\n".join(f"{pad}{json.dumps(str(k))}: {dumps(x, level + 1)}" for k, x in v.items()) + end + "}"
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return "[\n" + ",\n".join(pad + json.dumps(x, default=str) for x in v) + end + "]"
    return json.dumps(v, default=str)


def save(bench: str, args, rows: list, *, name: str = None, tables: dict = None, labels: dict = None,
         json_path=None, **extra) -> pathlib.Path:
    """Writes <out>/<name>.json and .csv (and .png with --plot); returns the JSON's path.

    bench: which plot draws it; name: the files' name, the bench's unless a variant of it has
    files of its own;
    rows: the printed table's rows, each a dict of its figures; tables: further tables by name
    (each its own CSV); labels: the table's column headings by key, for the plot's legend;
    extra: more of the run (raw figures, series), into the JSON only. json_path: write the JSON
    there instead (its CSVs and PNG beside it)."""
    name = name or bench
    path = pathlib.Path(json_path) if json_path else pathlib.Path(args.out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "bench": bench,
        "name": name,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **source(),
        "machine": machine(),
        "params": params(args),
        "rows": rows,
        "tables": tables or {},
        "labels": labels or {},
        **extra,
    }
    path.write_text(dumps(data) + "\n")
    written = [path]
    stem = path.with_suffix("")
    if rows:
        write_csv(stem.with_suffix(".csv"), rows)
        written.append(stem.with_suffix(".csv"))
    for table, trows in (tables or {}).items():
        if trows:
            p = stem.parent / f"{stem.name}-{table}.csv"
            write_csv(p, trows)
            written.append(p)
    if getattr(args, "plot", False):
        written.append(plot(path))
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return path


# ---------------------------------------------------------------------------------------------
# Plots: one function per bench, each drawing from the JSON alone.


def _title(data: dict, what: str) -> str:
    commit = data.get("commit") or "unknown commit"
    if data.get("dirty"):
        commit += " + uncommitted changes"
    m = data.get("machine", {})
    return (f"{what}\ncommit {commit}, {str(data.get('date', ''))[:10]}, {m.get('node', '?')} "
            f"({m.get('cores', '?')} cores)")


def _bars(ax, groups, series: dict, log=False):
    """Grouped bars: one group per entry of `groups`, one bar per series (label -> values,
    None for a missing bar)."""
    import numpy as np

    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(series.items()):
        vals = [float("nan") if v is None else v for v in values]
        ax.bar(x - 0.4 + width * (i + 0.5), vals, width, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels(groups)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both" if log else "major")


def plot_delivery(data, ax):
    labels = data.get("labels", {})
    rows = data["rows"]
    if rows and "recommended_per_s" in rows[0]:
        keys = ["recommended", "shm", "port", "baseline", "memcpy"]
        _bars(ax, [r["shape"] for r in rows],
              {labels.get(k, k): [r.get(f"{k}_per_s") for r in rows] for k in keys}, log=True)
        ax.set_xlabel("sample shape (uint8)")
        ax.set_ylabel("samples/s (median epoch, log)")
        return "Samples reaching a training loop, per shape"
    oom = rows  # delivery-oom.json: the --oom-mb case
    _bars(ax, [f"{r['shape']}, {r['mb']:.0f} MB, cgroups of {r['cgroup_mb']:.0f} MB" for r in oom],
          {"baseline h5py DataLoader x2": [r["baseline_per_s"] for r in oom],
           "larder torch (recommended)": [r["larder_per_s"] for r in oom]})
    ax.set_ylabel("samples/s (median epoch)")
    return "A dataset that does not fit in memory"


def plot_images(data, ax):
    rows = {r["setup"]: r["samples_per_s"] for r in data["rows"]}
    # The cold epoch against torchvision and the pool's limit; warm epochs are a copy at memory
    # speed and would flatten the rest.
    shown = [k for k in rows if "warm epochs" not in k]
    kinds = {"torchvision": ("tab:gray", "torchvision"), "larder cold": ("tab:orange", "larder, cold epoch"),
             "larder": ("tab:blue", "larder, other")}
    seen = set()
    for i, k in enumerate(shown):
        kind = next(p for p in kinds if k.startswith(p))
        color, label = kinds[kind]
        ax.bar(i, rows[k], color=color, label=None if kind in seen else label)
        seen.add(kind)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([k.replace(" (", "\n(").replace(", ", ",\n", 1) for k in shown], fontsize=7)
    pool = data.get("pool")
    if pool:
        ax.axhline(pool["full_per_s"], color="tab:red", linestyle="--",
                   label=f"the pool at full use ({pool['threads']} threads, criterion's time per image)")
    ax.set_ylabel("samples/s (median of the rounds)")
    ax.grid(axis="y", alpha=0.3)
    return "A folder of JPEGs: the cold epoch against torchvision and the pool's limit"


def plot_jobs(data, ax):
    rows = data["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["config"], r["policy"]): r for r in rows}
    import numpy as np

    width = 0.8 / max(len(policies), 1)
    x = np.arange(len(configs))
    for i, pol in enumerate(policies):
        xs = x - 0.4 + width * (i + 0.5)
        hits = [by[(c, pol)]["hits_pct"] if (c, pol) in by else float("nan") for c in configs]
        best = [by[(c, pol)]["belady_pct"] if (c, pol) in by else float("nan") for c in configs]
        ax.bar(xs, hits, width, label=f"larder, {pol}")
        ax.scatter(xs, best, marker="_", s=600 * width, color="black", zorder=3,
                   label="Belady on that run's trace" if i == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels([c.replace("s", " one seed") for c in configs])
    ax.set_xlabel("configuration: jobs x memory tier (% of the samples)")
    ax.set_ylabel("hits (% of lookups)")
    ax.grid(axis="y", alpha=0.3)
    return "Memory-tier hits with concurrent jobs against Belady's optimum"


def plot_gridsearch(data, ax):
    rows = data["rows"]
    _bars(ax, [str(r["epoch"]) + (" (cold)" if r.get("cold") else "") for r in rows],
          {f"torchvision x{data['params'].get('jobs', '?')}": [r["torchvision_per_s"] for r in rows],
           f"larder x{data['params'].get('jobs', '?')}": [r["larder_per_s"] for r in rows]})
    ax.set_xlabel("epoch")
    ax.set_ylabel("samples/s, all jobs")
    seeds = "one seed" if data["params"].get("one_seed") else "distinct seeds"
    return f"A grid search on data larger than memory, per epoch ({seeds})"


def plot_soak(data, ax):
    MiB = 1 << 20
    readings = data["tables"].get("readings", [])
    samples = [s for s in data["tables"].get("samples", []) if s.get("phase") == "run"]
    ax.plot([r["t"] / 60 for r in readings], [r["RssAnon"] / MiB for r in readings], lw=0.8,
            label="anonymous (RssAnon)")
    ax.plot([r["t"] / 60 for r in readings], [r["VmRSS"] / MiB for r in readings], lw=0.8,
            label="resident (VmRSS)")
    if samples:
        ax.plot([s["t"] / 60 for s in samples], [s["shm_bytes"] / MiB for s in samples], lw=0.8,
                label="rings (shared memory)")
        ax.plot([s["t"] / 60 for s in samples], [s["memory_bytes"] / MiB for s in samples], lw=0.8,
                label="memory tier")
    budget = data.get("memory_budget_bytes")
    if budget:
        ax.axhline(budget / MiB, color="black", linestyle="--", lw=0.8, label="memory budget")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    return f"larderd's memory during a {data['params'].get('minutes', '?')}-minute soak"


def plot_frameworks(data, ax):
    rows = data["rows"]
    ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows], color="tab:blue",
           label=f"2 processes, {data['params'].get('shape', '?')}, median epoch after a warm one")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["setup"].replace(", ", ",\n") for r in rows])
    ax.set_ylabel("samples/s across both processes")
    ax.grid(axis="y", alpha=0.3)
    return "Two processes under torchrun: samples/s per setup"


def plot_readers(data, ax):
    rows = data["rows"]
    kinds = list(dict.fromkeys(r["data"] for r in rows))
    setups = list(dict.fromkeys((r.get("build", "this"), r["setup"]) for r in rows))
    series = {(f"{s} ({b} build)" if len(setups) > 2 else s):
              [next((r["samples_per_s"] for r in rows if r["data"] == k and r["setup"] == s
                     and r.get("build", "this") == b), 0) for k in kinds] for b, s in setups}
    _bars(ax, kinds, series)
    ax.set_ylabel("samples/s, cold epoch (median of rounds)")
    return "Read and decoded in the daemon or in a reader as the files' owner"


def plot_formats(data, ax):
    rows = data["rows"]
    kinds = [r["format"] for r in rows]
    _bars(ax, kinds, {"larder": [r["larder_per_s"] for r in rows],
                      "the format's own loader (DataLoader, 2 workers)": [r["loader_per_s"] for r in rows]},
          log=True)
    ax.set_ylabel("samples/s, cold epoch (median of rounds)")
    return "Cold epochs of each format: larder against the format's own loader"


def plot_gpu(data, ax):
    rows = data["rows"]
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    epochs = ["cold", "warm"]
    series = {s: [next((r["images_per_s"] for r in rows if r["setup"] == s and r["epoch"] == e), 0)
                  for e in epochs] for s in setups}
    _bars(ax, [f"{e} epoch" for e in epochs], series)
    ax.axhline(data["ceiling"]["images_per_s"], color="grey", linestyle="--",
               label="the loop on data already on the GPU")
    ax.set_ylabel("images/s into ResNet-50 training (median of rounds)")
    return f"ResNet-50 (AMP, channels_last) on one {data.get('gpu', 'GPU')}, fed by torchvision and by larder"


def plot_budget(data, ax):
    rows = data["rows"]
    shares = sorted({r["budget_share"] for r in rows})
    labels = [f"budget {s:.0%} of the records" for s in shares]
    series = {}
    for build in ("before", "this"):
        series[f"{build} build"] = [next((r["held_share"] * 100 for r in rows
                                          if r["build"] == build and r["budget_share"] == s), 0) for s in shares]
    _bars(ax, labels, series)
    ax.set_ylabel("% of the dataset's samples held")
    return "Samples a memory budget holds (3x64x64 uint8 records): slabs against size classes"


def plot_objects(data, ax):
    rows = data["rows"]
    kinds = [r["format"] for r in rows]
    _bars(ax, kinds, {"local disk": [r["local_per_s"] for r in rows],
                      "S3 on loopback (SeaweedFS)": [r["s3_per_s"] for r in rows]})
    ax.set_ylabel("samples/s, cold epoch (median of rounds)")
    return "Cold epochs from an object store against the same data on local disk"


def plot_tenancy(data, ax):
    rows = data["rows"]
    import textwrap

    _bars(ax, [textwrap.fill(r["condition"], 14) for r in rows],
          {"alice's cold epoch, against bob idle": [r["vs_idle"] for r in rows]})
    ax.axhline(1.5, color="grey", linestyle="--", label="1.5x")
    ax.set_ylabel("alice's cold epoch / with bob idle (median of rounds)")
    return "What one user's attacks cost another's cold epoch (readers as their owners)"


def plot_scale(data, ax):
    rows = data["rows"]
    n = [r["samples"] for r in rows]
    lines = {"first batch, form 2 (computed order)": "first_batch_ms", "first batch, form 1 (listed)": "v1_first_batch_ms",
             "PlanStream, form 2": "plan_ms", "PlanStream, form 1": "v1_plan_ms"}
    for label, key in lines.items():
        if rows and key in rows[0]:
            ax.plot(n, [r[key] for r in rows], marker="o", linestyle="--" if "form 1" in label else "-",
                    label=f"npy: {label}")
    images = data.get("tables", {}).get("images") or []
    if images:
        files = [r["files"] for r in images]
        ax.plot(files, [r["open_s"] * 1e3 for r in images], marker="s", label="image folder: larder open")
        ax.plot(files, [r["reopen_s"] * 1e3 for r in images], marker="s", label="image folder: reopen after a restart")
        ax.plot(files, [r["scandir_stat_s"] * 1e3 for r in images], marker="^", color="grey",
                label="image folder: os.scandir + stat")
        if images[0].get("imagefolder_s") is not None:
            ax.plot(files, [r["imagefolder_s"] * 1e3 for r in images], marker="v", color="black",
                    label="image folder: torchvision ImageFolder()")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("samples (files)")
    ax.set_ylabel("ms")
    return "What a stream's start and a dataset's open cost as the dataset grows"


PLOTS = {
    "scale": plot_scale,
    "tenancy": plot_tenancy,
    "budget": plot_budget,
    "objects": plot_objects,
    "delivery": plot_delivery,
    "images": plot_images,
    "jobs": plot_jobs,
    "gridsearch": plot_gridsearch,
    "soak": plot_soak,
    "frameworks": plot_frameworks,
    "readers": plot_readers,
    "formats": plot_formats,
    "gpu": plot_gpu,
}


def plot(json_path, png=None) -> pathlib.Path:
    """Draws the plot of a bench's JSON; returns the PNG's path (beside the JSON by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path = pathlib.Path(json_path)
    data = json.loads(json_path.read_text())
    draw = PLOTS.get(data.get("bench"))
    if draw is None:
        raise SystemExit(f"{json_path}: no plot for bench {data.get('bench')!r} (known: {', '.join(PLOTS)})")
    fig, ax = plt.subplots(figsize=(9, 5))
    what = draw(data, ax)
    ax.set_title(_title(data, what), fontsize=10)
    if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = pathlib.Path(png) if png else json_path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main() -> int:
    p = argparse.ArgumentParser(description="Draws a bench's plot again from its saved JSON.")
    p.add_argument("--plot", required=True, metavar="JSON", help="a bench's JSON (benches/results/<bench>.json)")
    p.add_argument("--png", help="where the PNG goes (default: beside the JSON)")
    args = p.parse_args()
    print(plot(args.plot, args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
