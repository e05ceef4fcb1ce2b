"""Expert-load statistics: token share, max/mean share and coefficient of variation per layer."""

import torch


def max_over_mean(load: torch.Tensor) -> float:
    return float(load.max() / load.mean().clamp_min(1e-12))


def coefficient_of_variation(load: torch.Tensor) -> float:
    return float(load.std(unbiased=False) / load.mean().clamp_min(1e-12))


def layer_stats(loads: list[torch.Tensor]) -> dict[str, list[float]]:
    return {
        "cv": [round(coefficient_of_variation(load), 4) for load in loads],
        "max_over_mean": [round(max_over_mean(load), 4) for load in loads],
        "share": [[round(float(x), 4) for x in load / load.sum()] for load in loads],
    }


def dropped_fraction(routers) -> float:
    assignments = sum(router.last_assignments for router in routers)
    return sum(router.last_dropped for router in routers) / max(assignments, 1)
