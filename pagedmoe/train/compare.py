"""Router comparison: one run per variant with identical data and steps, a table and a load-CV plot."""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedmoe.train.config import ROUTERS, TrainConfig  # noqa: E402
from pagedmoe.train.model import build_model, hf_model_class, parameter_counts  # noqa: E402
from pagedmoe.train.tokenizer import load_tokenizer  # noqa: E402
from pagedmoe.train.trainer import CONFIG, read_metrics, train  # noqa: E402

SMOOTHING = 25


def run_variants(base: TrainConfig, routers: list[str], root: Path) -> list[Path]:
    return [train(base.replace(router=router, out_dir=str(Path(root) / router))) for router in routers]


def per_layer_mean(rows: list[dict], key: str) -> list[float]:
    return [round(statistics.fmean(values), 3) for values in zip(*(row[key] for row in rows))]


def summarize(run_dir: Path) -> dict:
    cfg = TrainConfig.load(Path(run_dir) / CONFIG)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if m["kind"] == "train"]
    last_eval = [m for m in metrics if m["kind"] == "eval"][-1]
    counts = parameter_counts(build_model(cfg, load_tokenizer(run_dir)), cfg)
    return {
        "router": cfg.router,
        "export_class": hf_model_class(cfg).__name__,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "steps": len(steps),
        "tokens": len(steps) * cfg.batch_size * cfg.seq_len,
        "val_loss": round(last_eval["val_loss"], 4),
        "end_cv": last_eval["val_cv"],
        "end_max_over_mean": last_eval["val_max_over_mean"],
        "train_cv_mean": per_layer_mean(steps, "cv"),
        "train_cv_last10": per_layer_mean(steps[-max(1, len(steps) // 10) :], "cv"),
        "aux_term_last10": aux_term(steps[-max(1, len(steps) // 10) :], cfg.effective_aux_coef),
        "dropped": round(statistics.fmean(m["dropped"] for m in steps), 4),
        "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in steps)),
        "wall_s": round(steps[-1]["elapsed_s"], 1),
    }


def aux_term(steps: list[dict], coef: float) -> float:
    return round(statistics.fmean(coef * m["aux"] for m in steps), 5)


def layers(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


TABLE_COLUMNS = [
    ("router", "router", str),
    ("export as", "export_class", str),
    ("params total / active", None, lambda r: f"{r['params_total'] / 1e6:.2f}M / {r['params_active'] / 1e6:.2f}M"),
    ("val loss", "val_loss", lambda v: f"{v:.3f}"),
    ("end CV per layer (val)", "end_cv", layers),
    ("end max/mean per layer (val)", "end_max_over_mean", layers),
    ("CV over training (mean)", "train_cv_mean", layers),
    ("CV last 10% steps", "train_cv_last10", layers),
    ("aux term (coef x aux, last 10%)", "aux_term_last10", lambda v: f"{v:.4f}"),
    ("dropped", "dropped", lambda v: f"{100 * v:.1f}%"),
    ("tokens/s", "tokens_per_s", str),
    ("wall s", "wall_s", str),
]


def markdown_table(rows: list[dict]) -> str:
    header = "| " + " | ".join(name for name, _, _ in TABLE_COLUMNS) + " |"
    rule = "|" + "---|" * len(TABLE_COLUMNS)
    body = ["| " + " | ".join(fmt(row[key] if key else row) for _, key, fmt in TABLE_COLUMNS) + " |" for row in rows]
    return "\n".join([header, rule, *body]) + "\n"


def smooth(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_load_cv(run_dirs: list[Path], path: Path) -> Path:
    runs = [(TrainConfig.load(Path(d) / CONFIG).router, [m for m in read_metrics(d) if m["kind"] == "train"]) for d in run_dirs]
    num_layers = len(runs[0][1][0]["cv"])
    figure, axes = plt.subplots(1, num_layers, figsize=(4 * num_layers, 3.6), sharey=True, squeeze=False)
    for layer, axis in enumerate(axes[0]):
        for router, steps in runs:
            axis.plot([m["step"] for m in steps], smooth([m["cv"][layer] for m in steps], SMOOTHING), label=router)
        axis.set(title=f"layer {layer}", xlabel="step", yscale="log")
    axes[0][0].set_ylabel(f"expert-load CV (train, {SMOOTHING}-step mean)")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return Path(path)


def compare(base: TrainConfig, root: Path, routers: list[str] = list(ROUTERS), plot_path: Path | None = None) -> str:
    run_dirs = run_variants(base, routers, root)
    rows = [summarize(d) for d in run_dirs]
    (Path(root) / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown_table(rows)
    (Path(root) / "summary.md").write_text(table)
    plot_load_cv(run_dirs, plot_path or Path(root) / "load_cv.png")
    return table
