"""The trainer loops' contracts on every path (flat, tree, DPO): options refused by field
rather than ignored, prompts encoded with the run's tokenizer (honouring `prompt_ids`) and
`task.check`, metrics and TensorBoard from process 0 only, closed, and the final-eval decision
broadcast (the step's temperature-consistent loss: steps_test.py)."""

import glob
import os
import time
import types

import jax
import numpy as np
import pytest

from branch_replay import rollout
from branch_replay.data import dpo, tasks, tree_task
from branch_replay.train import metrics, runtime, summary
from branch_replay.train import trainer
from branch_replay.train import state as train_state
from branch_replay.data.tokenizer import TOKENIZER, CharTokenizer
from helpers import CountingAlgorithm, loop_config, short_tree_run


class _Stop(Exception):
  pass


# ----------------------------------------------------------------------------- (4) refusals


@pytest.mark.parametrize(
  "override, field",
  [
    ("algo.advantage=rloo,tree.fanouts=4x1", "algo.advantage='rloo'"),  # a single child
    ("sampler.trunk_len=2", "sampler.trunk_len=2"),
    ("train.n_branches=4", "train.n_branches=4"),
  ],
)
def test_tree_refuses_options_it_cannot_serve(override, field):
  with pytest.raises(ValueError, match=r"^" + field.replace("(", r"\(") + " with tree.fanouts"):
    short_tree_run(*override.split(","))


def test_tree_trains_epochs_minibatches_and_kl_on_a_mesh(tmp_path, monkeypatch):
  """Trees take GRPO's update: epochs x minibatches, the KL reference scored per node, a
  mesh (prompts over data, leaves over context), with the PPO diagnostics."""
  cfg = short_tree_run(
    "train.sft_steps=0",
    "train.rl_steps=1",
    "train.batch_size=4",
    "algo.ppo_epochs=2",
    "algo.minibatches=2",
    "loss.kl_coef=0.05",
    "sampler.temperature=0.7",
    "mesh=data:2,context:4",
    "train.eval_size=0",
  )
  batches = []
  rl_batch = rollout.rl_batch

  def keep(*args, **kwargs):
    batch, rewards, stats = rl_batch(*args, **kwargs)
    batches.append(batch)
    return batch, rewards, stats

  monkeypatch.setattr(rollout, "rl_batch", keep)
  summary = trainer.run(cfg, str(tmp_path / "run"))
  records = metrics.read(summary["metrics"])
  train_recs = [r for r in records if r["kind"] == "train"]
  assert len(train_recs) == 1 and len(batches) == 1
  for r in train_recs:
    for key in ("loss/policy", "kl", "clip_frac", "approx_kl", "ratio/max", "grad/norm"):
      assert np.isfinite(r[key]), (key, r)
  # The reference is the policy as RL begins, scored at the sampling temperature: on the
  # first batch it equals the sampler's own log-probs, node by node.
  for level in batches[0].levels:
    assert level.ref_logp_BRT is not None
    np.testing.assert_allclose(level.ref_logp_BRT, level.old_logp_BRT, atol=2e-5)
  # Four updates of the batch: after the first, the ratios move off 1 (the old log-probs
  # are the sampler's) and the policy drifts from the reference.
  assert train_recs[0]["ratio/max"] > 1.0 and train_recs[0]["kl"] > 0.0


def test_tree_branch_chunk_divides_the_last_fanout():
  with pytest.raises(
    ValueError,
    match=r"replay.branch_chunk=3: expected a divisor of the last "
    r"fan-out 4",
  ):
    short_tree_run("tree.fanouts=3x4", "replay.branch_chunk=3")
  cfg = short_tree_run("tree.fanouts=2x3", "replay.branch_chunk=3")  # 8 branches: not the rule
  assert cfg.replay.branch_chunk == 3 and not cfg.uses_critic
  assert short_tree_run("algo.advantage=dr_grpo").algo.advantage == "dr_grpo"


def test_the_config_checks_the_tasks_turns():
  """A task states its rollout shape (tasks.Task.turns); the config holds tree.fanouts to it."""
  with pytest.raises(
    ValueError, match=r"tree.fanouts='4': task 'tree_haystack' is sampled as a tree of its 2 turns"
  ):
    short_tree_run("tree.fanouts=4")
  with pytest.raises(ValueError, match=r"tree.fanouts='2x2' with task.name='haystack': the task's"):
    short_tree_run("task.name=haystack")


# ----------------------------------------------------------------------------- (5) prompts


RUN_TOKENIZER = CharTokenizer()  # another instance than the default TOKENIZER


class _Checked:
  """A task mixin: built with the run's tokenizer (else fails at once), refuses in check."""

  def __init__(self, cfg, tokenizer=TOKENIZER):
    if tokenizer is not RUN_TOKENIZER:
      raise AssertionError("the task was built without the run's tokenizer")
    super().__init__(cfg, tokenizer)

  def check(self, cfg):
    raise ValueError("task.check ran")


tasks.register("checked_haystack")(type("CheckedHaystack", (_Checked, tasks.Haystack), {}))
tasks.register("checked_tree")(type("CheckedTree", (_Checked, tree_task.TreeHaystack), {}))


@pytest.mark.parametrize(
  "overrides",
  [
    ["task.name=checked_tree"],
    [
      "task.name=checked_haystack",
      "tree.fanouts=",
      "train.n_branches=2",
      "algo.name=dpo",
      "loss.name=dpo",
      "train.eval_size=0",
    ],
  ],
)
def test_run_builds_the_task_with_its_tokenizer_and_checks_it(tmp_path, overrides):
  cfg = short_tree_run(*overrides)
  with pytest.raises(ValueError, match="task.check ran"):
    trainer.run(cfg, str(tmp_path / "run"), tokenizer=RUN_TOKENIZER)


def test_tree_rollout_encodes_prompt_ids(monkeypatch):
  cfg = short_tree_run()
  task = tasks.make(cfg.task)
  ids = (TOKENIZER.bos_id, *TOKENIZER.encode("abc?k"))  # not the prompt's own text
  base = task.sample
  monkeypatch.setattr(
    task, "sample", lambda rng: tree_task.TreeExample(**{**vars(base(rng)), "prompt_ids": ids})
  )
  seen = {}

  def sample(params, prompt_BP, prompt_valid_BP, key):
    seen.update(prompt_BP=prompt_BP, valid_BP=prompt_valid_BP)
    raise _Stop

  state = types.SimpleNamespace(params=None, base=None, rng=jax.random.key_data(jax.random.key(0)))
  with pytest.raises(_Stop):
    rollout.rl_batch(
      types.SimpleNamespace(sample=sample), state, task, runtime.Runtime(cfg, TOKENIZER), 0
    )
  P = task.max_prompt_len
  np.testing.assert_array_equal(np.asarray(seen["prompt_BP"])[:, P - len(ids) :], [ids, ids])
  assert np.asarray(seen["valid_BP"]).sum(1).tolist() == [len(ids)] * 2


def test_dpo_pairs_encode_prompt_ids():
  ids = (TOKENIZER.bos_id, *TOKENIZER.encode("xy"))
  pairs = [dpo.Pair("a long prompt", "1", "2", prompt_ids=ids), dpo.Pair("ab", "3", "4")]
  batch = dpo.make_batch(pairs, 8, 1)
  np.testing.assert_array_equal(batch.root_BP[0, -3:], ids)
  assert batch.root_valid_BP[0].sum() == 3
  np.testing.assert_array_equal(batch.root_BP[1, -3:], [TOKENIZER.bos_id, *TOKENIZER.encode("ab")])
  task = tasks.make(tasks.TaskConfig(name="haystack", prompt_len=16, n_keys=2))
  ex = task.sample(np.random.default_rng(3))
  with_ids = types.SimpleNamespace(
    sample=lambda rng: tasks.Example(ex.prompt, ex.answer, prompt_ids=ids)
  )
  assert dpo.task_pair(with_ids, np.random.default_rng(0)).prompt_ids == ids


# ----------------------------------------------------------------------------- (6) writers


def test_final_eval_decision_is_broadcast(monkeypatch):
  from jax.experimental import multihost_utils

  calls = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(
    multihost_utils, "broadcast_one_to_all", lambda x: calls.append(int(x)) or np.int32(0)
  )
  assert not trainer.final_eval_missing([], 4)  # process 0's decision (here: 0) wins
  assert calls == [1]


class _SpyWriter(metrics.MetricsWriter):
  made = []

  def __init__(self, path, tensorboard=False):
    super().__init__(path, tensorboard)
    self.closed = False
    self.tensorboard = tensorboard
    _SpyWriter.made.append(self)

  def close(self):
    super().close()
    self.closed = True


class _OtherProcess:
  """The jax module as process 1 of 2 sees it (for one module's view only)."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def process_index(self):
    return 1


def test_tree_run_writes_on_process_zero_only(tmp_path, monkeypatch):
  _SpyWriter.made.clear()
  monkeypatch.setattr(metrics, "MetricsWriter", _SpyWriter)
  decided = []
  real = trainer.final_eval_missing
  monkeypatch.setattr(
    trainer, "final_eval_missing", lambda records, step: decided.append(step) or real(records, step)
  )
  cfg = short_tree_run("train.tensorboard=true", "train.sft_steps=0")  # (warm-up trees: -m slow)
  out = trainer.run(cfg, str(tmp_path / "chief"))
  recs = metrics.read(out["metrics"])
  (rec,) = [r for r in recs if r["kind"] == "train"]
  assert rec["phase"] == "rl" and 0 <= rec["reward/mean"] <= 1
  assert np.isfinite(rec["loss/policy"])
  assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 1] and decided == [1]
  # 2 prompts x (16 root + 2 x 1 first-turn + 4 x 2 second-turn positions); naive: 4 paths
  assert rec["replay/computed_tokens"] == 2 * (16 + 2 * 1 + 4 * 2)
  assert rec["replay/naive_equiv_tokens"] == 2 * 4 * (16 + 1 + 2)
  assert glob.glob(str(tmp_path / "chief" / "events.out.tfevents.*"))
  assert [(w.tensorboard, w.closed) for w in _SpyWriter.made] == [(True, True)]
  # Process 1 of a multi-host run computes alike and writes no metrics.
  monkeypatch.setattr(trainer, "jax", _OtherProcess())
  out = trainer.run(cfg, str(tmp_path / "other"))
  assert out["metrics"] == os.devnull and not os.path.exists(tmp_path / "other" / "metrics.jsonl")
  assert not glob.glob(str(tmp_path / "other" / "events.out.tfevents.*"))
  assert [(w.tensorboard, w.closed) for w in _SpyWriter.made[1:]] == [(False, True)]


# ----------------------------------------------------------------------------- the loop alone


def test_loop_resumes_from_its_checkpoint(tmp_path):
  workdir = str(tmp_path / "w")
  first = metrics.read(trainer.run(loop_config(), workdir, CountingAlgorithm)["metrics"])
  assert [(r["step"], r["phase"]) for r in first] == [(0, "sft"), (1, "rl"), (2, "rl")]
  assert CountingAlgorithm.made[-1].steps == ["start", 1, 2]
  assert first[1]["replay/computed_tokens"] == 1 + 2  # prefix + tails
  second = trainer.run(loop_config("train.rl_steps=4"), workdir, CountingAlgorithm)
  assert CountingAlgorithm.made[-1].steps == [3, 4]  # restored at 3; the phase had started
  assert [r["step"] for r in metrics.read(second["metrics"])] == [0, 1, 2, 3, 4]
  # the summary counts the resumed run's steps, its earlier ones included (train/summary.py)
  assert (second["steps"], second["phase_steps"], second["phase"]) == (5, 4, "rl")
  expected = jax.tree.leaves(train_state.init_state(loop_config()).params)[0]
  for _ in range(5):  # 5 steps in all, each adding 1 (float32, in order)
    expected = expected + 1
  np.testing.assert_array_equal(
    np.asarray(jax.tree.leaves(second["final_params"])[0]), np.asarray(expected)
  )


class _SlowEvaluation(CountingAlgorithm):
  """CountingAlgorithm with one held-out prompt whose greedy evaluation takes 1.5 s."""

  def eval_examples(self):
    return ["prompt"]

  def evaluate(self, state, examples):
    time.sleep(1.5)
    return np.ones(len(examples))


def test_the_evaluations_are_no_part_of_a_steps_time(tmp_path):
  """The evaluation before the phase runs inside its first step's iteration; time/step_s (and
  the summary's train_time_s) leave it out, as they leave out the one after the last step."""
  out = trainer.run(loop_config("train.eval_size=1"), str(tmp_path / "w"), _SlowEvaluation)
  recs = metrics.read(out["metrics"])
  assert [r["step"] for r in recs if r["kind"] == "eval"] == [1, 3]  # before and after RL
  steps = [r["time/step_s"] for r in recs if r["kind"] == "train"]
  assert len(steps) == 3 and max(steps) < 1.5, steps
  assert out["train_time_s"] < 1.5 and out["wall_s"] > 3.0


def test_nan_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  class NaNAt2(CountingAlgorithm):
    nan_at = 2

  workdir = str(tmp_path / "w")
  with pytest.raises(
    FloatingPointError,
    match=r"loss/policy is nan at step 2: stopping; the "
    r"last good checkpoint is step 2 in .*checkpoints",
  ):
    trainer.run(loop_config(), workdir, NaNAt2)
  assert [r["step"] for r in metrics.read(os.path.join(workdir, "metrics.jsonl"))] == [0, 1]
  with pytest.raises(
    FloatingPointError,
    match=r"at step 0: stopping; no checkpoint was "
    r"written yet",
  ):
    trainer.run(
      loop_config("train.sft_steps=0"),
      str(tmp_path / "v"),
      type("NaNAt0", (CountingAlgorithm,), {"nan_at": 0}),
    )


# ----------------------------------------------------------------------------- the algo section


@pytest.mark.parametrize("tree_run", [False, True], ids=["flat", "tree"])
def test_sft_algorithm_is_the_warmup_as_a_run(tmp_path, tree_run):
  """algo.name=sft trains train.sft_steps supervised steps (phase 'sft' throughout) and
  evaluates greedily before and after; its parameters are exactly those GRPO's warm-up
  reaches in as many steps (the same batches and step)."""
  make = (
    (lambda *o: short_tree_run("train.eval_size=2", *o))
    if tree_run
    else (lambda *o: loop_config("train.eval_size=2", "train.tensorboard=true", *o))
  )
  sft = trainer.run(
    make("algo.name=sft", "train.sft_steps=2", "train.rl_steps=0"), str(tmp_path / "sft")
  )
  records = metrics.read(sft["metrics"])
  train_rows = [r for r in records if r["kind"] == "train"]
  assert [(r["step"], r["phase"]) for r in train_rows] == [(0, "sft"), (1, "sft")]
  assert sorted(r["step"] for r in records if r["kind"] == "eval") == [0, 2]
  assert sft["first"]["loss/policy"] == train_rows[0]["loss/policy"]  # window 1 of 2 steps
  assert sft["last"]["loss/policy"] == train_rows[1]["loss/policy"]
  assert sft["eval_before"] is not None and sft["eval_after"] is not None
  assert "greedy eval reward before/after SFT" in summary.render(sft)
  warm = trainer.run(
    make("train.sft_steps=2", "train.rl_steps=0", "train.eval_size=0"), str(tmp_path / "grpo")
  )
  for a, b in zip(jax.tree.leaves(sft["final_params"]), jax.tree.leaves(warm["final_params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
