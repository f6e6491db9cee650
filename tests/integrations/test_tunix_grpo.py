"""The add-on for Tunix's GRPO learner: bit-identical to stock, fewer host blocks, clean refusals."""

from __future__ import annotations

import types

import pytest

from integrations.tunix_grpo import AddonUsageError, compat, install
from integrations.tunix_grpo.compat import UnsupportedTunixError
from integrations.tunix_grpo.throttle import CountingThrottler

pytestmark = pytest.mark.engine


# ---------------------------------------------------------------- refusals (no model needed)
def _fake_learner(**overrides):
  trainer = types.SimpleNamespace(
      _throttler=CountingThrottler(2, drain_each_call=True), _train_steps=0, _iter_steps=0,
      config=types.SimpleNamespace(data_sharding_axis=("fsdp",), max_inflight_computations=2))
  cluster = types.SimpleNamespace(_actor_trainer=trainer, _get_mesh_and_logical_axis_rules_cm=None, global_steps=0,
                                  cluster_config=types.SimpleNamespace(offload_to_cpu=False))
  learner = types.SimpleNamespace(**{name: None for name, _ in compat.LEARNER_ATTRIBUTES})
  learner.rl_cluster = cluster
  learner._training_config = types.SimpleNamespace(max_seq_token_per_tpu=None)
  for path, value in overrides.items():
    obj, _, name = path.rpartition(".")
    target = {"": learner, "cluster": cluster, "trainer": trainer}[obj]
    if value is _DELETE:
      delattr(target, name)
    else:
      setattr(target, name, value)
  return learner


_DELETE = object()


def test_a_complete_learner_passes_the_check():
  compat.check(_fake_learner())


def _one_line(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message
  return message


def test_another_tunix_version_is_refused_in_one_line():
  with pytest.raises(UnsupportedTunixError) as excinfo:
    compat.check(_fake_learner(), version="0.2.0")
  message = _one_line(excinfo)
  assert "google-tunix 0.2.0" in message and "google-tunix==0.1.7" in message


def test_no_tunix_installed_is_refused(monkeypatch):
  monkeypatch.setattr(compat, "installed_version", lambda: None)
  with pytest.raises(UnsupportedTunixError, match="google-tunix is not installed"):
    compat.check(_fake_learner())


@pytest.mark.parametrize("path, named", [
    ("cluster._actor_trainer", "_actor_trainer"),
    ("trainer._throttler", "_throttler"),
    ("_run_all_micro_batch_steps", "_run_all_micro_batch_steps"),
    ("executor", "executor"),
])
def test_a_missing_private_attribute_is_refused_by_name(path, named):
  with pytest.raises(UnsupportedTunixError) as excinfo:
    compat.check(_fake_learner(**{path: _DELETE}))
  assert named in _one_line(excinfo)


@pytest.mark.parametrize("path, value, named", [
    ("_training_config", types.SimpleNamespace(max_seq_token_per_tpu=256), "max_seq_token_per_tpu=256"),
    ("cluster._critic_trainer", object(), "critic"),
    ("cluster.cluster_config", types.SimpleNamespace(offload_to_cpu=True), "offload_to_cpu=True"),
    ("trainer._throttler", object(), "lacks add_computation()"),
])
def test_settings_the_add_on_cannot_reproduce_are_refused(path, value, named):
  with pytest.raises(UnsupportedTunixError) as excinfo:
    compat.check(_fake_learner(**{path: value}))
  assert named in _one_line(excinfo)


# ---------------------------------------------------------------- install and uninstall (no model needed)
class _StockLearner:
  """A learner whose loop methods live on its class, as a Tunix learner's do."""

  def _run_global_step(self, *args):
    raise AssertionError("not run in these tests")

  def _run_all_micro_batch_steps(self, *args):
    raise AssertionError("not run in these tests")


def _stock_learner() -> _StockLearner:
  learner = _StockLearner()
  for name, value in vars(_fake_learner()).items():
    if name not in ("_run_global_step", "_run_all_micro_batch_steps"):
      setattr(learner, name, value)
  return learner


def _assert_stock(learner, throttler) -> None:
  """The learner is exactly as built: its own throttler object, its class's very loop functions."""
  assert learner.rl_cluster._actor_trainer._throttler is throttler
  assert "_run_global_step" not in vars(learner) and "_run_all_micro_batch_steps" not in vars(learner)
  assert learner._run_global_step.__func__ is _StockLearner._run_global_step
  assert learner._run_all_micro_batch_steps.__func__ is _StockLearner._run_all_micro_batch_steps


def test_install_replaces_the_throttler_and_loops_and_uninstall_restores_them_exactly():
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  addon = install(learner, "stage_before_update")
  # Negative control for _assert_stock: installed, the learner is not stock.
  with pytest.raises(AssertionError):
    _assert_stock(learner, stock)
  assert learner._run_all_micro_batch_steps.__func__ is type(addon)._run_all_micro_batch_steps
  assert learner.rl_cluster._actor_trainer._throttler is addon.throttler and addon.installed
  addon.uninstall()
  _assert_stock(learner, stock)
  assert not addon.installed


def test_a_second_install_on_one_learner_is_refused_naming_the_learner_and_the_fix():
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  first = install(learner, "stage_before_update")
  with pytest.raises(AddonUsageError) as excinfo:
    install(learner, "pipelined")
  message = _one_line(excinfo)
  assert "already installed" in message and f"{id(learner):#x}" in message and "uninstall()" in message
  # The refused install changed nothing: the first add-on is still the one installed.
  assert first.installed and learner.rl_cluster._actor_trainer._throttler is first.throttler
  first.uninstall()
  _assert_stock(learner, stock)


def test_install_uninstall_twice_over_restores_the_stock_learner_each_time():
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  for mode in ("stage_before_update", "off"):
    addon = install(learner, mode)
    assert learner.rl_cluster._actor_trainer._throttler is addon.throttler
    addon.uninstall()
    _assert_stock(learner, stock)


def test_a_second_uninstall_is_refused_and_changes_nothing():
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  addon = install(learner, "stage_before_update")
  addon.uninstall()
  with pytest.raises(AddonUsageError, match="uninstalled from its learner .* already"):
    addon.uninstall()
  _assert_stock(learner, stock)


def test_a_stale_add_on_cannot_uninstall_the_one_installed_since():
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  old = install(learner, "stage_before_update")
  old.uninstall()
  new = install(learner, "pipelined")
  with pytest.raises(AddonUsageError, match="another add-on is installed"):
    old.uninstall()
  assert new.installed and learner.rl_cluster._actor_trainer._throttler is new.throttler
  new.uninstall()
  _assert_stock(learner, stock)


@pytest.mark.parametrize("value", [0, -3, 1.5, 2.0, "2", True])
def test_max_inflight_that_bounds_nothing_is_refused_naming_the_value(value):
  learner = _stock_learner()
  stock = learner.rl_cluster._actor_trainer._throttler
  with pytest.raises(ValueError) as excinfo:
    install(learner, "stage_before_update", max_inflight=value)
  assert f"max_inflight={value!r}" in _one_line(excinfo) and ">= 1" in str(excinfo.value)
  _assert_stock(learner, stock)


def test_a_positive_max_inflight_is_the_throttlers_bound():
  learner = _stock_learner()
  addon = install(learner, "stage_before_update", max_inflight=1)
  assert addon.throttler.max_inflight == 1
  addon.uninstall()


# ---------------------------------------------------------------- the throttle
class _Handle:
  def __init__(self, log):
    self.log = log

  def block_until_ready(self):
    self.log.append(self)
    return self


def test_the_throttle_drains_each_call_only_when_asked(monkeypatch):
  waited = []
  monkeypatch.setattr("jax.block_until_ready", lambda x: x.block_until_ready())
  stock = CountingThrottler(2, drain_each_call=True)
  stock.add_computation(_Handle(waited))
  stock.wait_for_all()
  assert len(waited) == 1 and stock.waits == 1 and len(stock) == 0
  addon = CountingThrottler(2, drain_each_call=False)
  for _ in range(3):
    addon.wait_for_next()
    addon.add_computation(_Handle(waited))
    addon.wait_for_all()
  # Only the in-flight bound waited: before the third dispatch, on the first.
  assert len(waited) == 2 and addon.waits == 1 and len(addon) == 2
  addon.drain()
  assert len(addon) == 0 and addon.waits == 3


# ---------------------------------------------------------------- real Tunix runs (child processes)
@pytest.fixture(scope="module")
def bench():
  from orchestrator.bench import tunix_grpo

  return tunix_grpo


@pytest.fixture(scope="module")
def shared(bench):
  """The shared-mesh toy: stock, the add-on, and the add-on staging wrong data (one process, three learners)."""
  toy = bench.Toy(layout="shared", mini_batches=1, micro_batches=2, global_steps=3)
  stock, staged, wrong = bench.run_arms_in_child(toy, [(None, {}), ("stage_before_update", {}),
                                                       ("stage_before_update", {"corrupt_staging": True})])
  return stock, staged, wrong


def test_shared_mesh_add_on_reaches_stock_weights_bit_for_bit(shared):
  stock, staged, _ = shared
  assert stock["optimizer_steps"] == staged["optimizer_steps"] == 3
  assert staged["digest"] == stock["digest"]
  # Stock drains after every micro-batch; the add-on does not.
  assert staged["host_blocks"] < stock["host_blocks"]
  # Shared weights: every next mini-batch samples on the update, so nothing is produced ahead,
  # but each micro-batch is placed by the producer thread, never by the trainer thread.
  assert staged["prefetched"] == 0 and staged["policy_counters"]["next_not_ready"] == 3
  assert stock["placements"]["other_threads"] == 0 and stock["placements"]["trainer_thread"] > 0
  assert staged["placements"]["trainer_thread"] == 0 and staged["placements"]["other_threads"] > 0
  # The report a user prints, and uninstall() puts Tunix's own throttler and loop methods back.
  assert "host blocks per step 0.00" in staged["summary_text"] and "0 next mini-batches produced ahead" in (
      staged["summary_text"])
  assert staged["uninstalled"] is True


def test_split_layout_add_on_reaches_stock_weights_in_every_mode(bench):
  """Four mini-batches per global step, each trained twice: the producer runs ahead of the trainer."""
  toy = bench.Toy(layout="split", mini_batches=4, micro_batches=2, global_steps=2, num_iterations=2)
  modes = ("off", "pipelined", "stage_before_update")
  stock, *arms = bench.run_arms_in_child(toy, [(None, {})] + [(mode, {}) for mode in modes])
  runs = dict(zip(modes, arms))
  assert stock["optimizer_steps"] == 16
  assert {r["digest"] for r in runs.values()} == {stock["digest"]}
  staged = runs["stage_before_update"]
  # Within a global step the sampler's weights do not change: each next mini-batch is produced ahead.
  assert staged["prefetched"] == 2 * 3 and staged["staged_share"] > 0
  assert staged["host_blocks"] < stock["host_blocks"]
  assert runs["off"]["prefetched"] == 0 and runs["off"]["placements"]["other_threads"] == 0


def test_a_wrongly_staged_micro_batch_changes_the_weights(shared):
  """Negative control: the identity tests would catch a stage that placed different data."""
  stock, _, wrong = shared
  assert wrong["digest"] != stock["digest"]
