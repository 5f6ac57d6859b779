"""Tracking: ``metrics.jsonl``, wandb, a progress bar, fixed metric namespaces, and PNG plots of a run."""

from feynrl_jax.tracking.metrics_file import METRICS_FILE, metric_series, read_metrics
from feynrl_jax.tracking.namespaces import NAMESPACES, check_metric_name
from feynrl_jax.tracking.plots import plot_run
from feynrl_jax.tracking.tracker import Tracker

__all__ = ["METRICS_FILE", "NAMESPACES", "Tracker", "check_metric_name", "metric_series", "plot_run", "read_metrics"]
