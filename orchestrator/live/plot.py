"""``reward.png``: a live run's mean reward and accuracy per step, with its boundary mode, and its held-out
evaluations during the run (``task.eval_every``) where it had them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_rewards(records: Sequence, path: Path, *, title: str) -> Path | None:
  """Draws the plot when the records carry rewards; returns its path (None: nothing to draw)."""
  points = [(r.step, r.reward_mean, r.accuracy) for r in records if r.reward_mean is not None]
  if not points:
    return None
  # import here: matplotlib costs run_rl ~0.6 s at start-up and can warn before a refusal; only a live run's end
  # draws, and the backend (files only, no display) is chosen before pyplot is imported
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # import here: after the backend is chosen
  steps, rewards, accuracy = zip(*points)
  fig, ax = plt.subplots(figsize=(8, 3.6))
  ax.plot(steps, rewards, label="mean reward", color="#4C78A8", linewidth=1)
  ax.plot(steps, accuracy, label="accuracy (the task's own check)", color="#F58518", linewidth=1, linestyle="--")
  for label, series, color in evaluation_series(records):
    ax.plot(*zip(*series), label=label, color=color, marker="o", markersize=4, linewidth=1)
  ax.set_xlabel("optimizer step")
  # rewards lie in [0, 1] unless task.reward_weights (or a reward of the user's) scale them: the axis shows all
  ax.set_ylim(min(0.0, *rewards) - 0.02, max(1.0, *rewards) + 0.02)
  ax.set_title(title, fontsize=10)
  ax.legend(loc="lower right", fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def evaluation_series(records: Sequence) -> list[tuple[str, list[tuple[int, float]], str]]:
  """The held-out evaluations during the run as (label, [(updates, figure)], colour), one series per figure the
  records carry: greedy accuracy and pass@k, each at the weights after ``step + 1`` updates."""
  greedy = [(r.step + 1, r.eval_accuracy) for r in records if getattr(r, "eval_accuracy", None) is not None]
  passed = [(r.step + 1, r.eval_pass_at_k) for r in records if getattr(r, "eval_pass_at_k", None) is not None]
  series = [("held-out accuracy, greedy", greedy, "#54A24B"), ("held-out pass@k", passed, "#B279A2")]
  return [entry for entry in series if entry[1]]
