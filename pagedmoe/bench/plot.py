"""PNG of a `bench serve` sweep: latency percentiles and throughput against the request rate."""
import math

LATENCIES = [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
             ("itl_p99_ms", "ITL p99"), ("tpot_p50_ms", "TPOT p50"), ("e2e_p50_ms", "E2E p50"),
             ("e2e_p99_ms", "E2E p99")]


def plot_serve(rows: list[dict], path: str, title: str = "pagedmoe bench serve"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = [_finite_rate(row["request_rate"], rows) for row in rows]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in LATENCIES:
        lat.plot(rates, [row[key] for row in rows], marker="o", label=label)
    lat.set(xlabel="request rate (req/s)", ylabel="latency (ms)", yscale="log", title="latency")
    thr.plot(rates, [row["output_tok_s"] for row in rows], marker="o", label="output tok/s")
    twin = thr.twinx()
    twin.plot(rates, [row["goodput_req_s"] for row in rows], marker="s", color="tab:green", label="goodput req/s")
    thr.set(xlabel="request rate (req/s)", ylabel="output tok/s", title="throughput")
    twin.set_ylabel("goodput (req/s)")
    for axis in (lat, thr):
        axis.set_xticks(rates, [f"{row['request_rate']:g}" for row in rows])
    lat.legend(fontsize=8)
    thr.legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _finite_rate(rate: float, rows: list[dict]) -> float:
    """rate = inf is drawn at twice the largest finite rate (or 1), labelled inf."""
    if not math.isinf(rate):
        return rate
    finite = [row["request_rate"] for row in rows if not math.isinf(row["request_rate"])]
    return 2 * max(finite) if finite else 1.0
