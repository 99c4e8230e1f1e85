"""Every script in experiments/, by kind, and the run configs `run.py --experiment=NAME`
finds (an explicit table: no file is grepped).

  configs  experiments/configs/: modules with get_config(), what run.py trains
           (python run.py --experiment=NAME; still importable as experiments.NAME)
  repro    the announcement's questions and comparisons (Q1-Q5, RL algorithms, ablations)
  bench    one training step measured (time, memory, FLOPs; JSON lines with provenance)
  tools    results files, tables, shared measuring helpers

A new script goes in exactly one kind (tests/experiments/experiments_test.py checks that every
experiments/*.py is listed); a new run config also becomes a valid --experiment name.
"""

from __future__ import annotations

import importlib

KINDS = {
  "configs": {
    "grpo_haystack": "GRPO on the long-prompt haystack retrieval task (the default run)",
    "grpo_arithmetic": "GRPO on two-digit addition (short prompts: replay saves little)",
    "ppo_haystack": "PPO with a critic (GAE, 2 epochs x 2 minibatches) on the haystack task",
    "dpo_haystack": "DPO pairs sharing the haystack prompt (R=2)",
    "tree_haystack": "tree GRPO on a two-turn lookup whose turns branch (4 x 4 trees)",
    "jsonl_reverse": "your own prompts: a JSON-lines file of 'reverse this word'",
    "math_jsonl": "GSM8K-layout k-shot math prompts for an imported checkpoint",
    "math_smollm2": "SmolLM2-135M-Instruct learns k-shot math with LoRA (the real-model recipe)",
    "needle_smollm2": "SmolLM2-135M-Instruct, LoRA, GRPO on the 4K-token multi-key needle task",
  },
  "repro": {
    "q1_wallclock": "Q1: the whole RL step by phase, replay vs naive",
    "q2_convergence": "Q2: reward curves over seeds and identical-batch gradients",
    "q3_memory_frontier": "Q3: the longest prefix each path fits under a memory cap",
    "cost_model": "Q4: FLOP/byte/memory counts, fitted on measured steps; 8-GPU prediction",
    "q5_objectives": "Q5: GRPO/GSPO/PPO/critic/DPO steps, replay vs naive",
    "rl_step": "one RL step taken apart by phase (Q1, Q2's building block)",
    "rl_compare": "GRPO, Dr. GRPO, GSPO, RLOO, PPO, DPO runs side by side",
    "phase_times": "the default run's RL step by phase (trainer metrics)",
    "ablations": "R, trunk W, branch_chunk, remat (notebooks/ablations.ipynb)",
    "rollout_strategies": "flat replay vs the automatic tree over rollout layouts",
    "fault_campaign": "SIGKILL at random moments, resumed: metrics equal the uninterrupted run's",
    "verify_tolerance": "replay vs naive at every RL step of a run: the self-check's tolerance",
    "longctx_accuracy": "SmolLM2's greedy accuracy on the needle / vartrack tasks by length",
  },
  "bench": {
    "bench_replay": "one loss+gradient step, naive vs replay (the step benchmark)",
    "bench_attention": "attention forward+backward, dense vs blockwise tiles",
    "bench_tree": "tree batches: naive vs flat replay vs tree replay",
    "bench_hybrid": "Gated DeltaNet hybrids beside pure attention",
    "bench_peer": "side by side with PrefixGrouper (torch)",
    "bench_reclaim": "our step with idle gaps: the host's page reclaim on a VM, per malloc setting",
    "bench_trl": "side by side with TRL's GRPOTrainer on SmolLM2-135M (the recipe's shape)",
    "longctx_speed": "ours, our naive twin and TRL on the needle recipe by prompt length",
    "time_to_accuracy": "TRL and ours under one wall-clock budget, adapters scored alike",
    "profile_replay": "where replay's step goes: stages and top XLA ops",
    "profile_peer": "where PrefixGrouper's step goes: aten ops by class (bench_peer's inputs)",
    "lora_memory": "LoRA vs full fine-tuning: compiled memory and speed",
    "context_parallel_memory": "per-device compiled memory under context parallelism",
    "plan_8gpu": "the 8-GPU plan from compiled footprints (Llama-3-8B shapes)",
    "plan_1gpu": "the one-GPU LoRA plan (8B, P=131,072, R=16) from compiled footprints; its GPU row",
    "fused_check": "model.attention=fused against blockwise (GPU path)",
    "bench_checkpoint": "asynchronous vs synchronous checkpoints: the step's stall",
    "gguf_smollm2": "the packaged SmolLM2 GGUF: load time by part and greedy answers",
  },
  "tools": {
    "provenance": "ResultsWriter: commit, command, machine on every results line",
    "results_table": "any results file as a markdown table",
    "tables": "the tables of README.md and docs/, rendered from results files",
    "table_specs": "what each rendered table reads",
    "registry": "this table",
    "measure": "measuring helpers shared by the benchmarks",
    "flops": "FLOPs of a step from the model shape (every benchmark and the cost model)",
    "compare": "relative error of one gradient against another (the benchmarks' checks)",
    "base": "experiments/configs/base.py: the model and schedule the run configs share",
    "hlo_collectives": "the collectives of a compiled HLO module, counted as executed",
    "gpu_target": "compile for a GPU with no GPU (XLA:GPU deviceless AOT): the memory plans",
    "gpu_preflight": "gpu_check.sh's first step: imports, versions, the card, the one-GPU shape",
  },
}

CONFIGS = tuple(KINDS["configs"])


def kind_of(name: str) -> str:
  for kind, names in KINDS.items():
    if name in names:
      return kind
  raise ValueError(f"experiments/{name}.py: not in experiments/registry.py KINDS")


def config_module(name: str):
  """The module of run config `name` (experiments/configs/NAME.py); a name not in CONFIGS is
  a ValueError listing them."""
  if name not in CONFIGS:
    raise ValueError(f"--experiment={name!r}: unknown; expected one of {sorted(CONFIGS)}")
  return importlib.import_module(f"experiments.configs.{name}")


def get_config(name: str):
  return config_module(name).get_config()


def run_module():
  """The checkout's run.py as a module (its flags, `parse`, `lora_options`), for scripts that
  train as `python run.py` does: run.py sits at the root, outside the installed packages, so
  `python experiments/NAME.py` cannot `import run` by name."""
  import importlib.util
  import os
  import sys

  if "run" in sys.modules and hasattr(sys.modules["run"], "config_from"):
    return sys.modules["run"]
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run.py")
  spec = importlib.util.spec_from_file_location("run", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["run"] = module
  spec.loader.exec_module(module)
  return module
