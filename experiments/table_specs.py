"""The results tables of README.md and docs/: for each, its header and the results files and
rows it reads (rendered by experiments/tables.py). Plus what experiments/results/INDEX.md
says of each file: which engine ran it and which file supersedes it.

A cell is a `str.format` template over one results line's fields; `{x}` alone formats as
results_table.fmt does (3 significant digits, `-` for null).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Source:
  """Rows of one results file: those matching every `where` (`key=value`), each rendered as
  one table row of `cells` templates. `count`: how many rows must match (None: any >= 1)."""

  file: str  # relative to experiments/results/
  cells: tuple[str, ...]
  where: tuple[str, ...] = ()
  count: int | None = None
  ratios: tuple[tuple, ...] = ()  # (name, numerator field, denominator field or number) added
  optional: tuple[str, ...] = ()  # fields a row may lack (rendered as -, e.g. after an oom)
  # (name, where): the one other row of the same file matching `where`, as field `name`
  # (a caveat's number read from its own line, e.g. "{p2048[ratio]:.2f}", never typed here)
  joins: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class Table:
  header: tuple[str, ...]
  sources: tuple[Source, ...]
  note: str = ""  # one line under the table, before the provenance line


# bench_peer.py at full strength, block protocol: 3 shapes x (back to back, 3 s pauses)
PEER_BLOCKS = "peer_cpu_blocks_2026-12-06.jsonl"

# bench_trl.py matched: remat full on ours, TRL's gradient checkpointing on; the in-run twin on
TRL_MATCHED = "trl_cpu_matched_2026-12-06.jsonl"
NEEDLE_RUN = "needle_smollm2_2026-12-07.jsonl"
# longctx_speed.py: ours, the naive twin and TRL on the needle recipe by prompt length
LONGCTX_SPEED = "longctx_speed_cpu_2026-12-07.jsonl"
# the same script at the seed's shape scaled by 1/16: B=1 x R=16 at P=8,192, ours alone
LONGCTX_16X8K = "longctx_16x8192_cpu_2026-12-07.jsonl"
# time_to_accuracy.py: TRL and ours under the same wall-clock budget, every adapter scored by ours
TIME_TO_ACC = "time_to_accuracy_cpu_2026-12-07.jsonl"
# the same run's adapters scored again (--rescore), each eval line with per-problem rewards
TIME_TO_ACC_PAIRED = "time_to_accuracy_rescored_cpu_2026-12-08.jsonl"

# experiments/verify_tolerance.py's summary lines
_VERIFY_CELLS = (
  "{run}",
  "{dtype} ({check_dtype})",
  "{base_dtype} / {trained_dtype}",
  "{n_steps} ({n_no_signal})",
  "{max_rel_err_max:.2g} ({max_rel_err_median:.2g})",
  "{loss_rel_err_max:.1e}",
  "{tolerance:g}",
  "{margin:.3g}x",
)

_BENCH_CPU = (
  "{prefix_len}",
  "{tail_len}",
  "{branches}",
  "{remat}",
  "{naive_s:.3g}",
  "{replay_s:.3g}",
  "{speedup:.2f}",
  "{flop_ratio:.2f}",
  "{speedup_over_flop_ratio:.2f}",
  "{naive_cpu_s:.3g}",
  "{replay_cpu_s:.3g}",
  "{naive_peak_mb:.0f}",
  "{replay_peak_mb:.0f}",
  "{grad_max_rel_err:.1e}",
  "{replay_gflops}",
  "{matmul_gflops}",
)

_MB = (
  ("state_mb", "trainable_state_bytes", 2**20),
  ("total_mb", "compiled_total_bytes", 2**20),
  ("temp_mb", "temp_bytes", 2**20),
)


def _longctx_point(P: int) -> Source:
  """One prompt length of longctx_speed.py: its curve line (each side's medians, peaks and timed
  steps; the ratios; with provenance) and ours' point line (the shape every side ran)."""
  return Source(
    LONGCTX_SPEED,
    (
      "{prompt_len:,}",
      "B={o[shape][B]} x R={o[shape][R]}, T={o[shape][T]}, LoRA r{o[shape][lora_rank]}, KL "
      "{o[shape][kl_beta]}, temperature {o[shape][temperature]}; ours: remat {o[shape][remat]}; "
      "TRL: gradient checkpointing {t[trl_settings][gradient_checkpointing]}, "
      "{t[trl_settings][attn_implementation]} attention, {t[trl_settings][torch_threads]} threads",
      "{step_s[ours]:.1f} / {step_s[naive]:.1f} / {step_s[trl]:.1f}",
      "{update_s[ours]:.1f} / {update_s[naive]:.1f} / {update_s[trl]:.1f}",
      "{ratio_trl_over_ours[update]:.1f}x",
      "{ratio_trl_over_ours[step]:.1f}x",
      "{ratio_naive_over_ours[update]:.2f}x",
      "{useful_flop_ratio:.2f}",
      "{peak_rss_mb[ours]:,.0f} / {peak_rss_mb[naive]:,.0f} / {peak_rss_mb[trl]:,.0f}",
      "{timed_steps[ours]} / {timed_steps[naive]} / {timed_steps[trl]}",
    ),
    ("kind=curve", f"prompt_len={P}"),
    1,
    joins=(
      ("o", ("kind=point", "side=ours", f"prompt_len={P}")),
      ("t", ("kind=point", "side=trl", f"prompt_len={P}")),
    ),
  )


_TTA_ACC = (
  "{e[eval/correct]}/{e[eval/n]} = {e[eval/greedy_reward]:.3f} [{e[eval/ci95_low]:.3f}, "
  "{e[eval/ci95_high]:.3f}]"
)


def _tta_row(who: str, label: str, steps: str, wall: str, step_s: str, versus: str) -> Source:
  """One adapter of time_to_accuracy.py: the run's summary line (its provenance) joined with
  the adapter's eval line (`e`) and its side's line (`s`)."""
  side = "trl" if who == "trl" else "ours"
  return Source(
    TIME_TO_ACC,
    (label, steps, wall, step_s, _TTA_ACC, versus),
    ("kind=summary",),
    1,
    joins=(("e", ("kind=eval", f"who={who}")), ("s", ("kind=side", f"side={side}"))),
  )


def _trl_phase(phase: str, label: str, digits: int) -> Source:
  """One phase of experiments/bench_trl.py's summary line: both medians and their ratio."""
  return Source(
    TRL_MATCHED,
    (
      label,
      f"{{median_s[ours][{phase}]:.{digits}f}}",
      f"{{median_s[trl][{phase}]:.{digits}f}}",
      f"{{ratio_trl_over_ours[{phase}]:.2f}}",
    ),
    ("summary=True",),
    1,
  )


def _peer_headline(P: int, T: int) -> Source:
  """The README's PrefixGrouper row at one shape: back to back, joined with its paused run."""
  shape = (f"prefix_len={P}", f"tail_len={T}")
  return Source(
    PEER_BLOCKS,
    (
      f"against PrefixGrouper (torch) at full strength, P={P}, R={{branches}}, T={{tail_len}}, "
      "quiet CPU: PrefixGrouper's time / ours (above 1: ours faster), back to back and with "
      "a {paused[gap_s]:g} s pause before every step of both; peak memory",
      "{ratio:.2f} back to back ({ours_s:.2f} vs {peer_s:.2f} s), {paused[ratio]:.2f} with "
      "pauses; peak {ours_peak_mb:,.0f} vs {peer_peak_mb:,.0f} MB",
      "{_model}, {dtype}; remat none on both sides; {blocks} blocks of {reps} steps a side, "
      "alternating (median of block medians); this machine's 2048^3 matmul: XLA "
      "{xla_matmul_gflops:.0f}, torch {torch_matmul_gflops:.0f} GFLOP/s; load {_load}; {_tree}",
      "`{_file}`",
    ),
    ("protocol=blocks", "gap_s=0.0", *shape),
    1,
    joins=(("paused", ("protocol=blocks", "gap_s=3.0", *shape)),),
  )


def _cp_memory(file: str) -> Table:
  """A context-parallel memory table (experiments/context_parallel_memory.py rows)."""
  return Table(
    ("preset", "P", "mesh", "per-device MB", "temporaries MB", "parameters + AdamW MB"),
    (
      Source(
        file,
        (
          "{preset}",
          "{P:,}",
          "{mesh}",
          "{per_device_mb:,.1f}",
          "{temp_mb:,.1f}",
          "{param_opt_mb:,.1f}",
        ),
        ("kind=row",),
      ),
    ),
  )


TABLES = {
  # ---- README ----
  "headline": Table(
    ("claim", "measured", "conditions", "results file"),
    (
      Source(
        "default_run_flat_2026-12-04.jsonl",
        (
          "the default run (`python run.py`) learns the task: sampled reward, greedy reward",
          "{reward_before:.3f} -> {reward_after:.3f}; {eval_before:.3f} -> {eval_after:.3f}",
          "`python run.py` as shipped (config grpo_haystack; model size not recorded in the file); {steps} steps, {rl_steps} of RL; 1 run; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "default_run_flat_2026-12-04.jsonl",
        (
          "token positions the default run computes vs its naive twin",
          "{computed_tokens:,} vs {naive_equiv_tokens:,}",
          "`python run.py` as shipped; summed over its {steps} steps; 1 run; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "math_smollm2_2026-12-04.jsonl",
        (
          "a real model, SmolLM2-135M-Instruct (GGUF Q4_1), 8-shot math: greedy accuracy on "
          "{eval_before_n} held-out problems before RL (95% Wilson interval)",
          "{eval_before_correct}/{eval_before_n} = {eval_before:.3f} "
          "[{eval_before_ci95[0]:.3f}, {eval_before_ci95[1]:.3f}]",
          "SmolLM2-135M-Instruct (GGUF Q4_1), LoRA r16 (compute dtype not recorded in the file); 1 run; load {_load} (shared machine); {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "math_smollm2_2026-12-04.jsonl",
        (
          "... after {rl_steps} GRPO steps with LoRA r16 (`--experiment=math_smollm2`, B=2 x R=8)",
          "{eval_after_correct}/{eval_after_n} = {eval_after:.3f} "
          "[{eval_after_ci95[0]:.3f}, {eval_after_ci95[1]:.3f}]",
          "as the row above; {rl_steps} RL steps; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        TRL_MATCHED,
        (
          "... one RL step side by side with TRL's `GRPOTrainer` (same model, prompts, B=2 x R=8, "
          "LoRA r16, KL 0.02), the same recomputation on both sides: ours vs TRL, median of the steps after warm-up; "
          "and ours against its naive twin on the same batches",
          "whole step {median_s[ours][step]:.1f} vs {median_s[trl][step]:.1f} s "
          "({ratio_trl_over_ours[step]:.1f}x); update {median_s[ours][update]:.1f} vs "
          "{median_s[trl][update]:.1f} s ({ratio_trl_over_ours[update]:.1f}x); twin: naive "
          "loss+grad {twin[time_ratio_naive_over_replay]:.1f}x replay's (useful-FLOP ratio "
          "{twin[useful_flop_ratio]:.1f})",
          "SmolLM2-135M-Instruct, B={shape[B]} x R={shape[R]}, T={shape[T]}, prompts {shape[prompt_tokens][0]} tokens, LoRA r{shape[lora_rank]}; remat: ours {shape[remat]}, TRL gradient checkpointing (matched); {steps} steps a side, alternating, the first {warmup} (warm-up) left out of the medians; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("summary=True",),
        1,
      ),
      Source(
        TIME_TO_ACC,
        (
          "... against TRL's `GRPOTrainer` from the same start, each given the same wall-clock "
          "budget: held-out greedy accuracy of each adapter, at equal time and at equal steps "
          "(`experiments/time_to_accuracy.py`; the table in docs/recipe.md)",
          "equal time: ours {equal_time[ours_equal_time][0]:.3f} "
          "[{equal_time[ours_equal_time][1]:.3f}, {equal_time[ours_equal_time][2]:.3f}] after "
          "{steps[ours]} steps vs TRL {equal_time[trl][0]:.3f} [{equal_time[trl][1]:.3f}, "
          "{equal_time[trl][2]:.3f}] after {steps[trl]}; equal steps ({steps[trl]}): ours "
          "{equal_steps[ours_equal_steps][0]:.3f} [{equal_steps[ours_equal_steps][1]:.3f}, "
          "{equal_steps[ours_equal_steps][2]:.3f}]; the base {b[eval/greedy_reward]:.3f}",
          "SmolLM2-135M-Instruct, B={s[shape][B]} x R={s[shape][R]}, T={s[shape][T]}, LoRA "
          "r{s[shape][lora_rank]}; remat: ours {s[shape][remat]}, TRL gradient checkpointing; "
          "{budget_s:,.0f} s of training a side (our compile inside it), TRL first, each in its "
          "own process; {b[eval/n]} held-out problems, Wilson 95%; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
        joins=(("s", ("kind=side", "side=ours")), ("b", ("kind=eval", "who=base"))),
      ),
      Source(
        LONGCTX_SPEED,
        (
          "long prompts on the real model: one GRPO step of the needle task at P={prompt_len:,} "
          "tokens, ours vs TRL's `GRPOTrainer` vs our naive twin, each in its own process "
          "(`experiments/longctx_speed.py`; every length in docs/recipe.md)",
          "whole step {step_s[ours]:.1f} vs {step_s[trl]:.1f} s "
          "({ratio_trl_over_ours[step]:.1f}x); update {update_s[ours]:.1f} vs "
          "{update_s[trl]:.1f} s ({ratio_trl_over_ours[update]:.1f}x); the naive twin's update "
          "{ratio_naive_over_ours[update]:.2f}x ours (useful-FLOP ratio {useful_flop_ratio:.2f}); "
          "peak RSS {peak_rss_mb[ours]:,.0f} vs {peak_rss_mb[trl]:,.0f} MB",
          "SmolLM2-135M-Instruct, float32, B={o[shape][B]} x R={o[shape][R]}, T={o[shape][T]}, "
          "LoRA r{o[shape][lora_rank]}, KL {o[shape][kl_beta]}; remat: ours {o[shape][remat]}, "
          "TRL gradient checkpointing; {timed_steps[ours]} / {timed_steps[trl]} timed steps "
          "(ours / TRL) after one warm-up; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=curve", "prompt_len=2048"),
        1,
        joins=(("o", ("kind=point", "side=ours", "prompt_len=2048")),),
      ),
      Source(
        LONGCTX_16X8K,
        (
          "the seed's 16 x 131,072 scaled by 1/16 on this CPU: one GRPO step (LoRA, KL) of a "
          "real model with R={o[shape][R]} branches of one {prompt_len:,}-token prompt, "
          "{o[shape][R]} x {prompt_len:,} = 131,072 prompt positions for a naive trainer",
          "whole step {step_s[ours]:.0f} s (sampling {generate_s[ours]:.0f}, reference "
          "{ref_logp_s[ours]:.0f}, update {update_s[ours]:.0f}); peak RSS "
          "{peak_rss_mb[ours]:,.0f} MB; the naive twin and TRL not run at this shape (their "
          "longest prompt measured: the row above)",
          "SmolLM2-135M-Instruct, float32, B={o[shape][B]} x R={o[shape][R]}, T={o[shape][T]}, "
          "LoRA r{o[shape][lora_rank]}, KL {o[shape][kl_beta]}, remat {o[shape][remat]}; "
          "{timed_steps[ours]} timed steps after one warm-up; useful-FLOP ratio "
          "{useful_flop_ratio:.1f}; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=curve", "prompt_len=8192"),
        1,
        joins=(("o", ("kind=point", "side=ours", "prompt_len=8192")),),
      ),
      Source(
        NEEDLE_RUN,
        (
          "long context on the real model: the multi-key needle task at "
          "{hdr[config][task][prompt_len]:,}-token prompts (16 keys hidden in filler), greedy "
          "accuracy on {eval_before_n} held-out problems before -> after {phase_steps} GRPO steps "
          "with LoRA r16 (`--experiment=needle_smollm2`, B=2 x R=8; 95% Wilson intervals)",
          "{eval_before_correct}/{eval_before_n} = {eval_before:.2f} "
          "[{eval_before_ci95[0]:.2f}, {eval_before_ci95[1]:.2f}] -> "
          "{eval_after_correct}/{eval_after_n} = {eval_after:.2f} "
          "[{eval_after_ci95[0]:.2f}, {eval_after_ci95[1]:.2f}]",
          "SmolLM2-135M-Instruct (GGUF Q4_1), float32, temperature 0.6; replay computed "
          "{phase_computed_tokens:,} token positions vs its naive twin's "
          "{phase_naive_equiv_tokens:,}; median RL step {median_phase_step_s:.0f} s; 1 run; "
          "load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=summary",),
        1,
        joins=(("hdr", ("kind=header",)),),
      ),
      Source(
        "cpu_long_context_2026-12-05.jsonl",
        (
          "one loss+gradient step, P={prefix_len}, R={branches}, T={tail_len}, CPU: replay vs naive",
          "{speedup:.2f}x faster ({speedup_over_flop_ratio:.2f} x the useful-FLOP ratio "
          "{flop_ratio:.2f}); peak {replay_peak_mb:,.0f} vs {naive_peak_mb:,.0f} MB",
          "{_model}, {dtype}, remat {remat} on both paths; {_reps} repetition(s); load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("prefix_len=8192", "remat=full"),
        1,
      ),
      *(_peer_headline(P, T) for P, T in ((2048, 128), (8192, 128), (1024, 512))),
      Source(
        "plan_1gpu_trainer_step_2026-12-05.jsonl",
        (
          "the seed's 16 x 131,072 positions on ONE GPU: Llama-3-8B, LoRA r16, bf16 base, the "
          "trainer's RL step (GRPO + KL: loss, gradient, AdamW; not sampling or its KV cache) "
          "compiled by XLA's GPU compiler for an H200, held against the memory `gpu_check.sh` "
          "gives JAX there (the fraction in the row; it runs this row on the card it finds, "
          "P=65,536 on an H100); no GPU run yet",
          "{total_gb:.1f} GB of {usable_gb[H200]:.1f} usable at memory fraction "
          "{mem_fraction} (within 90%: {fits_with_headroom[H200]})",
          "Llama-3-8B shapes ({n_layers} layers), base {base_dtype}, adapters {adapter_dtype}, "
          "compute {compute_dtype}, remat {remat}, P={P:,}, R={R}, T={T}; compiled, not run",
          "`{_file}`",
        ),
        ("model=llama3_8b", "P=131072", "target=H200"),
        1,
      ),
      Source(
        "q1_cpu_2026-12-05.jsonl",
        (
          "the whole RL step (sampling included), P={P}, R={R}",
          "{step_speedup_of_replay:.1f}x faster (update alone {update_speedup_of_replay:.1f}x)",
          "model {model[n_layers]} layers, d={model[d_model]}; B={B}, T={T} (answer tokens); {steps} steps a mode; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("mode=naive", "P=1024"),
        1,
      ),
      Source(
        "q3_cpu_2026-11-30.jsonl",
        (
          "longest prefix in 20 GB (compiled), R={R}, T={T}: {mode}",
          "{longest_prefix:,} positions",
          "{_model}, {dtype}, remat {remat}; compiled memory, not run; cap {cap_mb:,} MB",
          "`{_file}`",
        ),
        ("kind=frontier", "R=16"),
        2,
      ),
      Source(
        "q2_cpu_5seeds_2026-11-30.jsonl",
        (
          "training converges the same (5 seeds per mode): steps with replay's mean inside "
          "naive's band",
          "{replay_mean_inside_naive_band:.0%}; final reward {final_reward_replay:.3f} vs "
          "{final_reward_naive:.3f}",
          "the default run (grpo_haystack) x 5 seeds per mode; {steps_compared} steps compared; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("kind=verdict",),
        1,
      ),
      Source(
        "tree_cpu_2026-12-05.jsonl",
        (
          "a 4x4 tree of rollouts, P={prefix_len}: tree replay vs naive",
          "{tree_speedup:.2f}x faster ({tree_cpu_speedup:.2f}x CPU time); peak "
          "{tree_peak_mb:,.0f} vs {naive_peak_mb:,.0f} MB",
          "{_model}, {dtype}, lengths {lengths}; {_reps} rounds; load {_load}; {_tree}",
          "`{_file}`",
        ),
        (),
        1,
      ),
      Source(
        "q5_cpu_rerun_2026-12-05.jsonl",
        (
          "PPO's policy step through replay, P={prefix_len}, R={branches}: CPU-time speedup",
          "{cpu_speedup:.2f}x (grad rel err {grad_max_rel_err:.1e})",
          "{_model}, {dtype}, remat {remat} on both paths, T={tail_len}; load {_load}; {_tree}",
          "`{_file}`",
        ),
        ("objective=ppo",),
        1,
      ),
    ),
  ),
  "recipe": Table(
    (
      "run",
      "sampling temperature",
      "RL steps",
      "sampled reward, first -> last window",
      "greedy accuracy, 200 held out: before [95%]",
      "after [95%]",
      "token positions: replay vs naive",
      "RL step s (median)",
    ),
    (
      Source(
        "math_smollm2_temp1_2026-12-03.jsonl",
        (
          "first try (stopped)",
          "1.0",
          "{steps}",
          "{reward_before:.3f} -> {reward_after:.3f}",
          "{eval_before:.3f} [{eval_before_ci95[0]:.3f}, {eval_before_ci95[1]:.3f}]",
          "-",
          "{rl_computed_tokens:,} vs {rl_naive_equiv_tokens:,}",
          "-",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "math_smollm2_2026-12-03.jsonl",
        (
          "the recipe",
          "0.6",
          "{rl_steps}",
          "{reward_before:.3f} -> {reward_after:.3f}",
          "(the first try's)",
          "{eval_after:.3f} [{eval_after_ci95[0]:.3f}, {eval_after_ci95[1]:.3f}]",
          "{rl_computed_tokens:,} vs {rl_naive_equiv_tokens:,}",
          "{median_rl_step_s:.0f}",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "math_smollm2_2026-12-04.jsonl",
        (
          "the recipe, 36 steps, our GGUF import",
          "0.6",
          "{rl_steps}",
          "{reward_before:.3f} -> {reward_after:.3f}",
          "{eval_before:.3f} [{eval_before_ci95[0]:.3f}, {eval_before_ci95[1]:.3f}]",
          "{eval_after:.3f} [{eval_after_ci95[0]:.3f}, {eval_after_ci95[1]:.3f}]",
          "{rl_computed_tokens:,} vs {rl_naive_equiv_tokens:,}",
          "{median_rl_step_s:.0f}",
        ),
        ("kind=summary",),
        1,
      ),
    ),
  ),
  "longctx_accuracy": Table(
    (
      "task",
      "prompt_len",
      "difficulty",
      "mean prompt tokens",
      "max new tokens",
      "held-out problems",
      "greedy accuracy [Wilson 95%]",
      "s (loaded CPU)",
    ),
    (
      Source(
        "longctx_accuracy_cpu_2026-12-05.jsonl",
        (
          "needle",
          "{prompt_len}",
          "{options[n_keys]} keys",
          "{mean_prompt_tokens:.0f}",
          "{max_new_tokens}",
          "{n}",
          "{correct}/{n} = {accuracy:.2f} [{ci95_low:.2f}, {ci95_high:.2f}]",
          "{seconds:.0f}",
        ),
        ("task=needle",),
      ),
      Source(
        "longctx_accuracy_cpu_2026-12-05.jsonl",
        (
          "vartrack",
          "{prompt_len}",
          "{options[hops]} hops, {options[distractors]} distractor chains",
          "{mean_prompt_tokens:.0f}",
          "{max_new_tokens}",
          "{n}",
          "{correct}/{n} = {accuracy:.2f} [{ci95_low:.2f}, {ci95_high:.2f}]",
          "{seconds:.0f}",
        ),
        ("task=vartrack",),
      ),
    ),
    "SmolLM2-135M-Instruct (GGUF Q4_1), greedy, the task's held-out split; a loaded 2-core CPU",
  ),
  "longctx_sampled": Table(
    (
      "task",
      "prompt_len",
      "difficulty",
      "temperature",
      "prompts x samples",
      "correct samples",
      "per-sample accuracy [Wilson 95%]",
      "groups with reward variance",
      "prompts with a correct sample",
      "s",
    ),
    (
      Source(
        "longctx_sampled_cpu_2026-12-06.jsonl",
        (
          "{task}",
          "{prompt_len}",
          "{options[n_keys]} keys",
          "{temperature}",
          "{n} x {samples}",
          "{correct}",
          "{accuracy:.2f} [{ci95_low:.2f}, {ci95_high:.2f}]",
          "{informative_frac:.2f}",
          "{prompts_with_any_correct}/{n}",
          "{seconds:.0f}",
        ),
        ("kind=sampled",),
      ),
    ),
    "SmolLM2-135M-Instruct (GGUF Q4_1), the RL sampler (max_new_tokens 10), the task's held-out "
    "split; samples of one prompt are not independent, so the interval understates the "
    "uncertainty; s: wall seconds on a 2-core CPU shared with a test run",
  ),
  "needle_recipe": Table(
    (
      "run",
      "prompt tokens (target)",
      "B x R",
      "RL steps",
      "sampled reward: first -> last steps (mean)",
      "greedy accuracy, held out: before [Wilson 95%]",
      "after [Wilson 95%]",
      "after's interval above before's",
      "token positions: replay vs naive",
      "RL step s (median)",
    ),
    (
      Source(
        NEEDLE_RUN,
        (
          "`--experiment=needle_smollm2`, 16 keys, LoRA r16, KL 0.02",
          "{hdr[config][task][prompt_len]:,}",
          "{hdr[config][train][batch_size]} x {hdr[config][train][n_branches]}",
          "{phase_steps}",
          "{first[reward/mean]:.3f} -> {last[reward/mean]:.3f} ({window} steps each)",
          "{eval_before_correct}/{eval_before_n} = {eval_before:.2f} "
          "[{eval_before_ci95[0]:.2f}, {eval_before_ci95[1]:.2f}]",
          "{eval_after_correct}/{eval_after_n} = {eval_after:.2f} "
          "[{eval_after_ci95[0]:.2f}, {eval_after_ci95[1]:.2f}]",
          "{eval_after_interval_above_before}",
          "{phase_computed_tokens:,} vs {phase_naive_equiv_tokens:,}",
          "{median_phase_step_s:.0f}",
        ),
        ("kind=summary",),
        1,
        joins=(("hdr", ("kind=header",)),),
      ),
    ),
    "SmolLM2-135M-Instruct (GGUF Q4_1, our importer), float32, temperature 0.6; the task's "
    "held-out split (disjoint from training draws), greedy; one run, its RL steps on a quiet 2-core "
    "CPU",
  ),
  "longctx_speed": Table(
    (
      "prompt tokens P",
      "shape (every side)",
      "whole step s: ours / naive / TRL",
      "update s: ours / naive / TRL",
      "update: TRL / ours",
      "whole step: TRL / ours",
      "update: naive / ours",
      "useful-FLOP ratio",
      "peak RSS MB: ours / naive / TRL",
      "timed steps: ours / naive / TRL",
    ),
    tuple(_longctx_point(P) for P in (1024, 2048)),
    "SmolLM2-135M-Instruct (GGUF Q4_1 through our importer; TRL reads the same weights as an HF "
    "folder), float32, the needle task (16 keys), medians of the steps after one warm-up; each "
    "side a process of its own, the order rotating per length, on a quiet 2-core CPU. The naive "
    "twin is ours with "
    "replay.mode=naive: its update computes every branch as its own sequence, its sampling and "
    "reference log-probs are ours",
  ),
  "time_to_accuracy": Table(
    (
      "adapter",
      "RL steps",
      "training wall s (budget)",
      "median step s (the first step's compile included)",
      "greedy accuracy, held out [Wilson 95%]",
      "minus TRL's accuracy; intervals overlap",
    ),
    (
      _tta_row("base", "the base (no RL)", "0", "-", "-", "-"),
      _tta_row(
        "trl",
        "TRL GRPOTrainer at the budget's end (gradient checkpointing "
        "{s[trl_settings][gradient_checkpointing]}, {s[trl_settings][attn_implementation]}, "
        "{s[trl_settings][torch_threads]} threads)",
        "{s[steps_run]}",
        "{s[train_wall_s]:,.0f} ({budget_s:,.0f})",
        "{s[median_s][trl][step]:.1f}",
        "-",
      ),
      _tta_row(
        "ours_equal_steps",
        "ours at TRL's step count (equal steps)",
        "{steps[trl]}",
        "-",
        "{s[median_s][ours][step]:.1f}",
        "{equal_steps[difference]:+.3f}; {equal_steps[intervals_overlap]}",
      ),
      _tta_row(
        "ours_equal_time",
        "ours at the budget's end (equal time; remat {s[shape][remat]})",
        "{s[steps_run]}",
        "{s[train_wall_s]:,.0f} ({budget_s:,.0f})",
        "{s[median_s][ours][step]:.1f}",
        "{equal_time[difference]:+.3f}; {equal_time[intervals_overlap]}",
      ),
    ),
    "`--experiment=math_smollm2` (SmolLM2-135M-Instruct, GGUF Q4_1; TRL reads the same weights "
    "as an HF folder), B=2 x R=8, T=40, LoRA r16 (B = 0 at the start, so both start from the "
    "base's function; each framework draws its own A), KL 0.02, AdamW lr 3e-4; each side a process of its own, TRL "
    "first, on a quiet 2-core CPU; every adapter (TRL's through models/lora.load_peft) scored by "
    "our greedy evaluation on the recipe's held-out problems",
  ),
  "time_to_accuracy_paired": Table(
    (
      "comparison",
      "accuracy: ours / TRL (rescored)",
      "problems both solved",
      "only ours",
      "only TRL",
      "neither",
      "exact McNemar p (two-sided)",
    ),
    (
      Source(
        TIME_TO_ACC_PAIRED,
        (
          "equal time: ours at the budget's end ({steps[ours]} steps) vs TRL ({steps[trl]})",
          "{equal_time[ours_equal_time][0]:.3f} / {equal_time[trl][0]:.3f}",
          "{paired_equal_time[both]}",
          "{paired_equal_time[only_a]}",
          "{paired_equal_time[only_b]}",
          "{paired_equal_time[neither]}",
          "{paired_equal_time[mcnemar_p]:.2g}",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        TIME_TO_ACC_PAIRED,
        (
          "equal steps: ours after {steps[trl]} steps vs TRL",
          "{equal_steps[ours_equal_steps][0]:.3f} / {equal_steps[trl][0]:.3f}",
          "{paired_equal_steps[both]}",
          "{paired_equal_steps[only_a]}",
          "{paired_equal_steps[only_b]}",
          "{paired_equal_steps[neither]}",
          "{paired_equal_steps[mcnemar_p]:.2g}",
        ),
        ("kind=summary",),
        1,
      ),
    ),
    "time_to_accuracy's adapters (the run above, its --workdir) scored again by "
    "`--rescore`, each problem's reward kept; the held-out problems as above",
  ),
  "trl": Table(
    (
      "phase (median s over the steps after warm-up)",
      "ours (branch replay, JAX)",
      "TRL GRPOTrainer",
      "TRL / ours",
    ),
    tuple(
      _trl_phase(phase, label, digits)
      for phase, label, digits in (
        ("generate", "generation (sampling)", 2),
        ("reward", "reward", 4),
        ("ref_logp", "reference log-probs", 2),
        ("update", "update (forward + backward + AdamW)", 2),
        ("step", "whole RL step", 2),
      )
    ),
  ),
  "trl_twin": Table(
    (
      "our batches (median s over the steps after warm-up)",
      "replay loss+grad",
      "naive twin loss+grad",
      "naive / replay",
      "useful-FLOP ratio",
      "worst loss gap, replay vs naive",
    ),
    (
      Source(
        TRL_MATCHED,
        (
          "B={shape[B]} x R={shape[R]}, prompts {shape[prompt_tokens][0]} tokens, T={shape[T]}, remat {shape[remat]}",
          "{twin[replay_s]:.2f}",
          "{twin[naive_s]:.2f}",
          "{twin[time_ratio_naive_over_replay]:.2f}",
          "{twin[useful_flop_ratio]:.2f}",
          "{twin[loss_max_gap]:.1e}",
        ),
        ("summary=True",),
        1,
      ),
    ),
  ),
  "jsonl_reverse": Table(
    (
      "warm-up steps",
      "warm-up answer loss: first -> step 450",
      "RL steps",
      "sampled reward (training prompts), first -> last 10",
      "greedy exact match held out: after warm-up -> after RL",
      "wall s",
    ),
    (
      Source(
        "jsonl_reverse_2026-11-30.jsonl",
        (
          "{sft_steps}",
          "{sft_loss_first:.2f} -> {sft_loss_step_450:.4f}",
          "{rl_steps}",
          "{sampled_reward_first10_rl:.3f} -> {sampled_reward_last10_rl:.3f}",
          "{eval_greedy_heldout_before_rl:.3f} -> {eval_greedy_heldout_after_rl:.3f}",
          "{wall_s:.0f}",
        ),
        (),
        1,
      ),
    ),
  ),
  # ---- docs/reproduction.md ----
  "default_run": Table(
    ("", "before RL", "after RL"),
    (
      Source(
        "default_run_flat_2026-12-04.jsonl",
        (
          "sampled `reward/mean` (mean of first / last 10 RL steps)",
          "{reward_before:.3f}",
          "{reward_after:.3f}",
        ),
        ("kind=summary",),
        1,
      ),
      Source(
        "default_run_flat_2026-12-04.jsonl",
        (
          "greedy reward on 128 held-out 256-token prompts",
          "{eval_before:.3f}",
          "{eval_after:.3f}",
        ),
        ("kind=summary",),
        1,
      ),
    ),
  ),
  "phase_times": Table(
    (
      "mode",
      "sample s",
      "reward s",
      "old_logp s",
      "ref_logp s",
      "update s",
      "step s",
      "RL total s (update)",
      "token positions",
    ),
    (
      Source(
        "phase_times_cpu_2026-12-01.jsonl",
        (
          "{mode}",
          "{sample_s:.3g}",
          "{reward_s:.2g}",
          "{old_logp_s}",
          "{ref_logp_s}",
          "{update_s:.3g}",
          "{step_s:.3g}",
          "{total_rl_step_s:.1f} ({total_update_s:.1f})",
          "{rl_computed_tokens:,}",
        ),
      ),
    ),
  ),
  "q1": Table(
    (
      "P",
      "mode",
      "step s",
      "update s",
      "sample s",
      "update share of step",
      "step speedup of replay",
      "update speedup of replay",
    ),
    (
      Source(
        "q1_cpu_2026-12-05.jsonl",
        (
          "{P:,}",
          "{mode}",
          "{step_s:.3g}",
          "{update_s:.3g}",
          "{sample_s:.3g}",
          "{update_share:.0%}",
          "",
          "",
        ),
        ("mode=replay",),
      ),
      Source(
        "q1_cpu_2026-12-05.jsonl",
        (
          "{P:,}",
          "{mode}",
          "{step_s:.3g}",
          "{update_s:.3g}",
          "{sample_s:.3g}",
          "{update_share:.0%}",
          "{step_speedup_of_replay:.1f}",
          "{update_speedup_of_replay:.1f}",
        ),
        ("mode=naive",),
      ),
    ),
  ),
  "q2_verdict": Table(
    (
      "runs",
      "replay's mean inside naive's band",
      "naive's mean inside replay's band",
      "final smoothed reward replay / naive",
    ),
    (
      Source(
        "q2_cpu_5seeds_2026-11-30.jsonl",
        (
          "5 seeds per mode, {steps_compared} RL steps, {smooth}-step running mean",
          "{replay_mean_inside_naive_band:.0%}",
          "{naive_mean_inside_replay_band:.0%}",
          "{final_reward_replay:.3f} / {final_reward_naive:.3f}",
        ),
        ("kind=verdict",),
        1,
      ),
    ),
  ),
  "q2_cosine": Table(
    ("RL step", "1 - cosine(replay grad, naive grad)", "relative difference"),
    (
      Source(
        "q2_cpu_2026-11-30.jsonl",
        ("{step}", "{one_minus_cosine:.1e}", "{grad_rel_diff:.1e}"),
        ("kind=cosine",),
      ),
    ),
  ),
  "q3": Table(
    ("mode", "R", "T", "longest P", "compiled MB there", "first failing P", "cap MB"),
    (
      Source(
        "q3_cpu_2026-11-30.jsonl",
        (
          "{mode}",
          "{R}",
          "{T}",
          "{longest_prefix:,}",
          "{compiled_mb_at_longest:,.0f}",
          "{first_failing:,}",
          "{cap_mb:,.0f}",
        ),
        ("kind=frontier",),
      ),
    ),
  ),
  "cost_model_fit": Table(
    ("machine", "points", "median error", "max error", "within 30%"),
    (
      Source(
        "cost_model_blockwise_2026-11-30.jsonl",
        (
          "{machine}",
          "{n_points}",
          "{median_abs_rel_err:.0%}",
          "{max_abs_rel_err:.0%}",
          "{within_30pct}/{n_points}",
        ),
        ("kind=fit",),
      ),
    ),
  ),
  "cost_model_prediction": Table(
    ("GPUs", "T", "mode", "s/step (range)", "PFLOP", "GB/device (model)", "fits"),
    (
      Source(
        "cost_model_blockwise_2026-11-30.jsonl",
        (
          "{gpus}",
          "{T}",
          "{mode}",
          "{step_s:.4g} ({step_s_range[0]:.4g}-{step_s_range[1]:.4g})",
          "{total_pflop:.1f}",
          "{memory_gb:.1f}",
          "{fits}",
        ),
        ("kind=prediction",),
      ),
    ),
  ),
  "q5": Table(
    (
      "objective",
      "R",
      "replay CPU s",
      "naive CPU s",
      "CPU speedup",
      "wall speedup",
      "useful-FLOP ratio",
      "grad max rel err",
      "compiled MB replay / naive",
    ),
    (
      Source(
        "q5_cpu_rerun_2026-12-05.jsonl",
        (
          "{objective}",
          "{branches}",
          "{replay_cpu_s:.3g}",
          "{naive_cpu_s:.3g}",
          "{cpu_speedup:.2f}",
          "{speedup:.2f}",
          "{flop_ratio:.2f}",
          "{grad_max_rel_err:.1e}",
          "{replay_compiled_mb:,.0f} / {naive_compiled_mb:,.0f}",
        ),
      ),
    ),
  ),
  # ---- docs/performance.md ----
  "peer": Table(
    (
      "P",
      "T",
      "R",
      "pause before each step s",
      "ours s (block medians)",
      "PrefixGrouper s (block medians)",
      "ratio PG / ours (per block)",
      "ours / PG kernel s a step",
      "ours / PG peak MB",
      "ours GFLOP/s, share of XLA matmul",
      "PG share of torch matmul",
      "grad rel err",
      "most other cores",
    ),
    (
      Source(
        PEER_BLOCKS,
        (
          "{prefix_len:,}",
          "{tail_len}",
          "{branches}",
          "{gap_s:g}",
          "{ours_s:.2f} {ours_block_s}",
          "{peer_s:.2f} {peer_block_s}",
          "**{ratio:.2f}** {block_ratios}",
          "{ours_sys_s:.2f} / {peer_sys_s:.2f}",
          "{ours_peak_mb:,.0f} / {peer_peak_mb:,.0f}",
          "{ours_gflops} ({ours_matmul_frac:.0%} of {xla_matmul_gflops})",
          "{peer_matmul_frac:.0%} of {torch_matmul_gflops}",
          "{grad_max_rel_err:.1e}",
          "{max_other_cores:.2f}",
        ),
        ("protocol=blocks",),
        6,
      ),
    ),
    note="Each framework in its own process; blocks alternate (ours x N, PrefixGrouper x N, "
    "repeated); the time is the median of the block medians. Both sides: the same decoder and "
    "weights, float32, no remat; PrefixGrouper's attention at full strength (torch's causal fast "
    "path on the square prefix call, causal_lower_right on the tails).",
  ),
  # ---- docs/training.md ----
  "verify_tolerance": Table(
    (
      "run (model)",
      "compute dtype (the check's)",
      "base / trained dtype",
      "batches checked (deferred: no signal)",
      "largest gradient error (median)",
      "largest loss error",
      "tolerance",
      "tolerance / largest error",
    ),
    (
      Source(
        "verify_tolerance_cpu_2026-12-05.jsonl",
        _VERIFY_CELLS,
        ("kind=summary", "run=grpo_haystack"),
        1,
        optional=("base_dtype", "trained_dtype", "dtype", "check_dtype"),
      ),
      Source(
        "verify_tolerance_cpu_2026-12-05.jsonl",
        _VERIFY_CELLS,
        ("kind=summary", "run=tree_haystack"),
        1,
        optional=("base_dtype", "trained_dtype", "dtype", "check_dtype"),
      ),
      Source(
        "verify_tolerance_smollm2_lora_cpu_2026-12-05.jsonl",
        _VERIFY_CELLS,
        ("kind=summary",),
        2,
        optional=("check_dtype",),
      ),
      Source(
        "verify_tolerance_smollm2_bf16_2026-12-06.jsonl",
        _VERIFY_CELLS,
        ("kind=summary",),
        1,
      ),
    ),
    note="Error: the worst gradient leaf's largest |replay - naive| over that leaf's largest "
    "entry (verify.py's measure) at every RL step of the run; a batch whose advantages are all "
    "zero is deferred by the trainer and not counted. With LoRA the adapters' gradients are "
    "compared (what the optimizer applies). The check's dtype in brackets ('-': a row from "
    "before it was recorded, checked in the run's own dtype).",
  ),
  "verify_dtype_gap": Table(
    (
      "run",
      "step",
      "bf16: replay vs naive (worst leaf)",
      "bf16 replay vs float32 (global)",
      "bf16 naive vs float32 (global)",
      "float32 check: replay vs naive",
      "loss: bf16 replay / bf16 naive / float32",
    ),
    (
      Source(
        "verify_tolerance_smollm2_bf16_2026-12-06.jsonl",
        (
          "{run}, LoRA over a {base_dtype} base",
          "{step}",
          "{half_max_rel_err:.2g} (`{half_worst_leaf}`)",
          "{half_vs_float32_global[replay]:.0%}",
          "{half_vs_float32_global[naive]:.0%}",
          "{max_rel_err:.2g}",
          "{half_loss[replay]:.4f} / {half_loss[naive]:.4f} / {half_loss[float32_naive]:.4f}",
        ),
        ("kind=step", "has_signal=true"),
      ),
    ),
    note="global: the norm of the difference over all adapter gradients over the float32 "
    "gradient's norm; float32 check: verify.py's measure in the check's own dtype.",
  ),
  "long_context": Table(
    (
      "P",
      "T",
      "R",
      "remat",
      "naive s",
      "replay s",
      "speedup",
      "useful-FLOP ratio",
      "speedup / FLOP ratio",
      "naive cpu s",
      "replay cpu s",
      "naive peak MB",
      "replay peak MB",
      "grad rel err",
      "replay GFLOP/s",
      "matmul GFLOP/s",
    ),
    (
      Source(
        "cpu_long_context_2026-11-30.jsonl",
        _BENCH_CPU,
        ("kind=-",),
        optional=("speedup_over_flop_ratio",),
      ),
      Source("cpu_long_context_2026-12-05.jsonl", _BENCH_CPU, ("kind=-",), 1),
    ),
  ),
  "idle_step": Table(
    (
      "P",
      "T",
      "R",
      "replay s (median of 5)",
      "replay cpu s",
      "peak MB",
      "useful GFLOP/s",
      "matmul GFLOP/s (right after)",
    ),
    (
      Source(
        "cpu_long_context_2026-11-30.jsonl",
        (
          "{prefix_len}",
          "{tail_len}",
          "{branches}",
          "{replay_s:.2f}",
          "{replay_cpu_s:.2f}",
          "{replay_peak_mb:.0f}",
          "{replay_gflops}",
          "{matmul_gflops}",
        ),
        ("kind=idle_replay_step",),
        1,
      ),
    ),
  ),
  "sweep": Table(
    (
      "P",
      "T",
      "R",
      "naive cpu s",
      "replay cpu s",
      "cpu speedup",
      "useful-FLOP ratio",
      "cpu speedup / FLOP ratio",
      "naive wall s",
      "replay wall s",
      "naive / replay compiled MB",
      "grad rel err",
    ),
    (
      Source(
        "cpu_sweep_blockwise_2026-11-30.jsonl",
        (
          "{prefix_len}",
          "{tail_len}",
          "{branches}",
          "{naive_cpu_s:.2f}",
          "{replay_cpu_s:.2f}",
          "{cpu_speedup:.2f}",
          "{flop_ratio:.2f}",
          "{cpu_ratio_over_flop:.2f}",
          "{naive_s:.2f}",
          "{replay_s:.2f}",
          "{naive_compiled_mb:.0f} / {replay_compiled_mb:.0f}",
          "{grad_max_rel_err:.1e}",
        ),
        ratios=(("cpu_ratio_over_flop", "cpu_speedup", "flop_ratio"),),
      ),
    ),
  ),
  "q5_haystack": Table(
    (
      "objective",
      "replay CPU s",
      "naive CPU s",
      "CPU speedup",
      "wall speedup",
      "useful-FLOP ratio",
      "grad max rel err",
      "compiled MB replay / naive",
    ),
    (
      Source(
        "q5_haystack_cpu_2026-11-30.jsonl",
        (
          "{objective}",
          "{replay_cpu_s:.3f}",
          "{naive_cpu_s:.3f}",
          "{cpu_speedup:.2f}",
          "{speedup:.2f}",
          "{flop_ratio:.2f}",
          "{grad_max_rel_err:.1e}",
          "{replay_compiled_mb:.0f} / {naive_compiled_mb:.0f}",
        ),
      ),
    ),
  ),
  # ---- docs/algorithms.md ----
  "rl_compare": Table(
    (
      "run",
      "RL steps",
      "sampled reward, first -> last 10 steps",
      "greedy eval before -> after",
      "wall s",
    ),
    (
      Source(
        "rl_compare_2026-11-30.jsonl",
        (
          "{algorithm}",
          "100",
          "{reward_before:.3f} -> {reward_after:.3f}",
          "{eval_before:.3f} -> {eval_after:.3f}",
          "{wall_s:.0f}",
        ),
        ("reward_window=10",),
      ),
      Source(
        "rl_compare_ppo_2026-11-30.jsonl",
        (
          "{algorithm}",
          "100",
          "{reward_before:.3f} -> {reward_after:.3f}",
          "{eval_before:.3f} -> {eval_after:.3f}",
          "{wall_s:.0f}",
        ),
      ),
      Source(
        "rl_compare_2026-11-30.jsonl",
        (
          "{algorithm} (accuracy, margin)",
          "{dpo_steps}",
          "{accuracy_first10:.3f} -> {accuracy_last10:.3f} (margin {margin_first10:.2f} -> "
          "{margin_last10:.2f})",
          "-",
          "{wall_s:.0f}",
        ),
        ("algorithm=dpo",),
        1,
      ),
    ),
  ),
  "ppo_haystack": Table(
    (
      "reward first -> last 10",
      "greedy eval",
      "clip_frac first -> last 10",
      "approx_kl last 10",
      "ratio/max last 10",
      "pooled explained variance first -> last 10",
      "wall s",
    ),
    (
      Source(
        "ppo_haystack_2026-11-30.jsonl",
        (
          "{reward_first10:.3f} -> {reward_last10:.3f}",
          "{eval_before:.3f} -> {eval_after:.3f}",
          "{clip_frac_first10:.3f} -> {clip_frac_last10:.3f}",
          "{approx_kl_last10:.3f}",
          "{ratio_max_last10:.2f}",
          "{explained_variance_pooled_first10:.2f} -> {explained_variance_pooled_last10:.2f}",
          "{wall_s:.0f}",
        ),
        (),
        1,
      ),
    ),
  ),
  # ---- docs/architectures.md (LoRA) ----
  "lora_memory": Table(
    ("P", "method", "mode", "trainable state MB", "compiled total MB", "temporaries MB"),
    tuple(
      Source(
        f,
        ("{P:,}", "{method}", "{mode}", "{state_mb:,.0f}", "{total_mb:,.0f}", "{temp_mb:,.0f}"),
        where,
        ratios=_MB,
      )
      for f, where in (
        ("lora_memory_large_cpu_2026-12-01.jsonl", ("P=8192",)),
        ("lora_memory_large32k_cpu_2026-12-01.jsonl", ()),
      )
    ),
  ),
  "lora_speed": Table(
    ("preset", "P", "R", "T", "method", "mode", "CPU s", "wall s"),
    (
      Source(
        "lora_speed4_cpu_2026-12-01.jsonl",
        ("{preset}", "{P}", "{R}", "{T}", "{method}", "{mode}", "{cpu_s:.2f}", "{wall_s:.1f}"),
      ),
    ),
  ),
  # ---- docs/trees.md ----
  "tree_bench": Table(
    (
      "P",
      "fan-out",
      "lengths",
      "naive s (CPU s)",
      "tree s (CPU s)",
      "tree speedup wall / CPU",
      "tree FLOP ratio",
      "speedup / FLOP ratio wall / CPU",
      "peak MB naive / tree",
      "grad rel err",
    ),
    (
      Source(
        "tree_cpu_2026-12-05.jsonl",
        (
          "{prefix_len}",
          "{fanouts}",
          "{lengths}",
          "{naive_s:.1f} ({naive_cpu_s:.1f})",
          "{tree_s:.2f} ({tree_cpu_s:.2f})",
          "{tree_speedup:.2f} / {tree_cpu_speedup:.2f}",
          "{tree_flop_ratio:.2f}",
          "{tree_speedup_over_flop_ratio:.3f} / {tree_cpu_speedup_over_flop_ratio:.3f}",
          "{naive_peak_mb:,.0f} / {tree_peak_mb:,.0f}",
          "{tree_grad_max_rel_err:.1e}",
        ),
        (),
        1,
      ),
    ),
  ),
  "auto_tree": Table(
    (
      "strategy",
      "P",
      "R",
      "T",
      "trunk",
      "flat replay s (cpu)",
      "tree s (cpu)",
      "speedup wall / cpu",
      "useful-FLOP ratio",
      "speedup / FLOP ratio wall / cpu",
      "grad rel err",
    ),
    (
      Source(
        "rollout_strategies_target_cpu_2026-12-01.jsonl",
        (
          "{strategy}",
          "{P}",
          "{R}",
          "{T}",
          "{trunk_len}",
          "{flat_replay_s:.2f} ({flat_replay_cpu_s:.2f})",
          "{tree_s:.2f} ({tree_cpu_s:.2f})",
          "{speedup:.2f} / {speedup_cpu:.2f}",
          "{flop_ratio:.2f}",
          "{speedup_over_flop_ratio:.2f} / {speedup_cpu_over_flop_ratio:.2f}",
          "{grad_max_rel_err:.1e}",
        ),
        (),
        1,
      ),
    ),
  ),
  # ---- docs/architectures.md ----
  "hybrid_memory": Table(
    ("preset", "P", "replay compiled MB", "naive compiled MB", "useful-FLOP ratio"),
    (
      Source(
        "hybrid_remat_cpu_2026-12-01.jsonl",
        (
          "{preset}",
          "{prefix_len:,}",
          "{replay_compiled_mb:,.0f}",
          "{naive_compiled_mb:,.0f}",
          "{flop_ratio:.2f}",
        ),
      ),
    ),
  ),
  "hybrid_speed": Table(
    (
      "preset",
      "P",
      "R",
      "T",
      "replay cpu s",
      "naive cpu s",
      "cpu speedup",
      "useful-FLOP ratio",
      "cpu speedup / FLOP ratio",
      "wall s replay / naive",
    ),
    (
      Source(
        "hybrid_speed_cpu_2026-12-01.jsonl",
        (
          "{preset}",
          "{prefix_len}",
          "{branches}",
          "{tail_len}",
          "{replay_cpu_s:.2f}",
          "{naive_cpu_s:.2f}",
          "{cpu_speedup:.2f}",
          "{flop_ratio:.2f}",
          "{cpu_speedup_over_flop_ratio:.2f}",
          "{replay_s:.2f} / {naive_s:.1f}",
        ),
      ),
    ),
  ),
  # ---- docs/sharding.md ----
  "cp_memory": Table(
    ("preset", "P", "mesh", "prefix attention", "per-device MB", "temporaries MB"),
    (
      Source(
        "context_parallel_memory_cpu.jsonl",
        ("{preset}", "{P:,}", "{mesh}", "{scheme}", "{per_device_mb:,.1f}", "{temp_mb:,.1f}"),
        ("kind=row",),
      ),
    ),
  ),
  "plan_8gpu": Table(
    (
      "mesh",
      "P",
      "T",
      "parameters over",
      "prefix cache in the tails",
      "per device GB (arguments / temporaries)",
      "fits H20 96 GB / H100 80 GB / H200 141 GB",
    ),
    (
      Source(
        "plan_8gpu_cpu_2026-12-02.jsonl",
        (
          "{mesh}",
          "{P:,}",
          "{T}",
          "{params}",
          "{cache}",
          "{per_device_gb:.1f} ({argument_gb:.1f} / {temp_gb:.1f})",
          "{fits[H20]} / {fits[H100]} / {fits[H200]}",
        ),
        ("kind=row",),
        optional=("cache",),
      ),
    ),
  ),
  "cp_cache_sharded": _cp_memory("context_parallel_memory_cache_sharded_cpu_2026-12-02.jsonl"),
  "cp_key_major": _cp_memory("context_parallel_memory_key_major_cpu_2026-12-02.jsonl"),
  "plan_8gpu_now": Table(
    (
      "mesh",
      "P",
      "per device GB (arguments / temporaries)",
      "fits H20 / H100 / H200",
      "compiled comm GB: total (K/V prefix, K/V tails, weights, grads)",
      "step s H20 / H100 / H200 (compiled comm)",
    ),
    (
      Source(
        "plan_8gpu_key_major_cpu_2026-12-02.jsonl",
        (
          "{mesh}",
          "{P:,}",
          "{per_device_gb:.1f} ({argument_gb:.1f} / {temp_gb:.1f})",
          "{fits[H20]} / {fits[H100]} / {fits[H200]}",
          "{total_gb:,.1f} ({kv_prefix_gb:.1f}, {kv_tails_gb:.1f}, {weights_gb:.1f}, {grads_gb:.1f})",
          "{prediction[step_time][8 x H20][step_s_compiled_comm]:.1f} / "
          "{prediction[step_time][8 x H100 SXM][step_s_compiled_comm]:.1f} / "
          "{prediction[step_time][8 x H200][step_s_compiled_comm]:.1f}",
        ),
        ("kind=row",),
        ratios=(
          ("kv_prefix_gb", "hlo_comm_bytes.kv_prefix", 1e9),
          ("kv_tails_gb", "hlo_comm_bytes.kv_tails", 1e9),
          ("weights_gb", "hlo_comm_bytes.weights", 1e9),
          ("grads_gb", "hlo_comm_bytes.grads", 1e9),
          ("total_gb", "hlo_comm_bytes.total", 1e9),
        ),
      ),
    ),
  ),
  "plan_1gpu": Table(
    (
      "model",
      "P",
      "compiled GB, XLA:GPU for H200: total (arguments / temporaries)",
      "within 90% of the memory JAX is given (0.95 of the card): H200 / H20 / H100",
      "GPU estimate GB (bf16, analytic)",
      "step s on one H200: 40% / 60% MFU / cost model",
    ),
    (
      Source(
        "plan_1gpu_trainer_step_2026-12-05.jsonl",
        (
          "{model}",
          "{P:,}",
          "{total_gb:.1f} ({argument_gb:.1f} / {temp_gb:.1f})",
          "{fits_with_headroom[H200]} / {fits_with_headroom[H20]} / {fits_with_headroom[H100]}",
          "{gpu_estimate_gb[total]:.1f}",
          "{prediction[step_s][H200][mfu_40]:.1f} / {prediction[step_s][H200][mfu_60]:.1f} / "
          "{prediction[step_s][H200][cost_model]:.1f}",
        ),
        ("kind=row", "target=H200"),
      ),
    ),
  ),
}

# INDEX.md: which engine produced a file where it matters (the dense engine's rows predate
# the blockwise attention) and which file replaces a superseded one.
ENGINE = {
  "cpu_sweep_2026-11-30.jsonl": "dense attention",
  "cost_model_2026-11-30.jsonl": "dense",
  "cost_model_2026-11-30.md": "dense",
  "default_run_2026-11-30.jsonl": "dense",
  "default_run_2026-11-30.png": "dense",
  "gpu_h200_2026-11-30.jsonl": "dense (H200)",
  "tree_cpu_2026-11-30.jsonl": "before the one engine",
  "default_run_d1fa8e0_rerun_2026-12-03.jsonl": "before the one batch type (rerun)",
  "default_run_2026-12-03.jsonl": "another machine (its float32 paths: first loss differs in the last bit)",
  "default_run_3d4842d_rerun_2026-12-04.jsonl": "before session 13's merges (rerun, same machine)",
  "default_run_99370c1_rerun_2026-12-04.jsonl": "after the rooms and the formatter (rerun, same machine)",
  "default_run_9eed8f1_rerun_2026-12-06.jsonl": "before issue 48's runtime (rerun, same machine)",
  "default_run_9af4c47_2026-12-06.jsonl": "before the one advantage module (GRPO advantages in float32; same machine)",
  "rollout_strategies_cpu_2026-12-01.jsonl": "before the one engine",
  "peer_cpu_before_2026-12-01.jsonl": "before issue 18's changes",
  "peer_cpu_after_2026-12-02.jsonl": "old protocol: single steps alternating; peer's explicit mask",
  "peer_cpu_quiet_sys_2026-12-05.jsonl": "old protocol: single steps alternating; peer's explicit mask",
  "profile_cpu_before_2026-12-01.jsonl": "before issue 18's changes",
  "profile_cpu_before_2026-12-01.md": "before issue 18's changes",
}
SUPERSEDED = {
  "trl_cpu_2026-12-04.jsonl": TRL_MATCHED,  # unmatched: TRL checkpointed, ours kept activations
  "cpu_sweep_2026-11-30.jsonl": "cpu_sweep_blockwise_2026-11-30.jsonl",
  "cost_model_2026-11-30.jsonl": "cost_model_blockwise_2026-11-30.jsonl",
  "cost_model_2026-11-30.md": "cost_model_blockwise_2026-11-30.md",
  "default_run_2026-11-30.jsonl": "default_run_long_context_2026-11-30.jsonl",
  "default_run_2026-11-30.png": "default_run_long_context_2026-11-30.png",
  "default_run_long_context_2026-11-30.jsonl": "default_run_2026-12-02.jsonl",
  "default_run_long_context_2026-11-30.png": "default_run_2026-12-02.png",
  "default_run_2026-12-02.jsonl": "default_run_2026-12-03.jsonl",
  "default_run_2026-12-02.png": "default_run_2026-12-03.png",
  "default_run_2026-12-03.jsonl": "default_run_2026-12-04.jsonl",
  "default_run_2026-12-03.png": "default_run_2026-12-04.png",
  "default_run_2026-12-04.jsonl": "default_run_flat_2026-12-04.jsonl",
  "plan_1gpu_gpu_aot_2026-12-04.jsonl": "plan_1gpu_gpu_aot_flat_2026-12-04.jsonl",
  "plan_1gpu_gpu_aot_flat_2026-12-04.jsonl": "plan_1gpu_gpu_aot_causal_2026-12-05.jsonl",
  "plan_1gpu_gpu_aot_causal_2026-12-05.jsonl": "plan_1gpu_trainer_step_2026-12-05.jsonl",
  "default_run_2026-12-04.png": "default_run_flat_2026-12-04.png",
  "tree_cpu_2026-11-30.jsonl": "tree_cpu_2026-12-01.jsonl",
  "tree_cpu_2026-12-01.jsonl": "tree_cpu_2026-12-02.jsonl",
  "tree_cpu_2026-12-02.jsonl": "tree_cpu_2026-12-05.jsonl",
  "tree_cpu_2026-12-03.jsonl": "tree_cpu_2026-12-05.jsonl",
  "q1_cpu_2026-11-30.jsonl": "q1_cpu_2026-12-05.jsonl",
  "q5_cpu_2026-11-30.jsonl": "q5_cpu_2026-12-05.jsonl",
  "peer_cpu_before_2026-12-01.jsonl": "peer_cpu_after_2026-12-02.jsonl",
  # the old protocol (single steps alternating between the processes; the peer's explicit mask)
  "peer_cpu_after_2026-12-02.jsonl": PEER_BLOCKS,
  "peer_cpu_quiet_sys_2026-12-05.jsonl": PEER_BLOCKS,
  "profile_cpu_before_2026-12-01.jsonl": "profile_cpu_after_2026-12-02.jsonl",
  "profile_cpu_before_2026-12-01.md": "profile_cpu_after_2026-12-02.md",
}
# non-JSON files: what they hold
COMPANIONS = {
  "ab_tiles_scan_cpu_2026-12-02.md": "attention tiles and layer scan A/B (notes)",
  "ci_suite_time_2026-12-02.md": "clean-clone CI suite time (notes)",
  "cost_model_2026-11-30.md": "cost_model (rendered)",
  "cost_model_blockwise_2026-11-30.md": "cost_model (rendered)",
  "default_run_2026-11-30.png": "default run (plot)",
  "default_run_long_context_2026-11-30.png": "default run (plot)",
  "default_run_2026-12-02.png": "default run (plot)",
  "default_run_2026-12-03.png": "default run (plot)",
  "default_run_2026-12-04.png": "default run (plot)",
  "default_run_flat_2026-12-04.png": "default run (plot)",
  "math_smollm2_2026-12-04.png": "the 36-step recipe run (plot)",
  "needle_smollm2_2026-12-07.png": "the long-context recipe's 16-step run (plot)",
  "longctx_speed_cpu_2026-12-07.png": "longctx_speed: seconds per step and speedups by P (plot)",
  "gpu_h200_2026-11-30_env.txt": "H200 device check (environment)",
  "lora_memory_2026-12-01.md": "lora_memory (rendered)",
  "plan_8gpu_cpu_2026-12-02.md": "plan_8gpu (rendered)",
  "profile_cpu_after_2026-12-02.md": "profile_replay (rendered)",
  "profile_cpu_before_2026-12-01.md": "profile_replay (rendered)",
  "profile_cpu_T512_2026-12-04.md": "profile_replay (rendered)",
  "profile_cpu_T512_transpose_2026-12-04.md": "profile_replay with the transpose class (rendered)",
  "profile_cpu_P2048_transpose_2026-12-04.md": "profile_replay with the transpose class (rendered)",
  "profile_cpu_P2048_2026-12-04.md": "profile_replay (rendered)",
  "q2_cpu_2026-11-30.png": "q2_convergence (plot)",
  "q2_cpu_5seeds_2026-11-30.png": "q2_convergence (plot)",
}

# experiments/README.md: the claim each published table or figure supports.
CLAIMS = {
  "headline": "the README's headline numbers, one row per claim",
  "default_run": "the default run learns the task: sampled and greedy reward before -> after RL",
  "jsonl_reverse": "your own prompts from a file: the warm-up fits them, RL keeps them",
  "trl": "our GRPO step against TRL's GRPOTrainer on the same model, prompts and settings, "
  "phase by phase",
  "time_to_accuracy": "TRL's GRPOTrainer and ours given the same wall-clock budget from the same "
  "start: held-out greedy accuracy at equal time and at equal steps",
  "time_to_accuracy_paired": "the time-to-accuracy adapters problem by problem: which problems "
  "only ours or only TRL solved, and the exact McNemar test",
  "trl_twin": "the same run's in-run twin: replay against its naive twin on our own batches "
  "(prefix sharing apart from the framework)",
  "longctx_accuracy": "SmolLM2-135M-Instruct's greedy accuracy on the needle and vartrack tasks "
  "by prompt length and difficulty",
  "longctx_sampled": "why the needle recipe's groups carry (or lack) a learning signal: sampled "
  "accuracy and reward variance by temperature at 4,096 tokens",
  "longctx_speed": "long prompts on the real model: one GRPO step of ours, our naive twin and "
  "TRL's GRPOTrainer by prompt length, each in its own process",
  "needle_recipe": "long context on a real model: SmolLM2-135M-Instruct with LoRA on the "
  "4,096-token multi-key needle task, greedy held-out accuracy before -> after RL",
  "recipe": "a real pretrained model (SmolLM2-135M-Instruct) trained with LoRA on k-shot math: "
  "greedy held-out accuracy before -> after RL",
  "lora_memory": "LoRA on the large preset: ~1% of the trainable state, replay's memory saving kept",
  "lora_speed": "LoRA keeps replay's speedup (within a few percent of full fine-tuning's)",
  "phase_times": "the RL step by phase: replay's update is ~8x cheaper; sampling is the rest",
  "q1": "Q1: the compute cut shortens the whole RL step (sampling included)",
  "q2_verdict": "Q2: replay and naive train the same within seed noise (5 seeds each)",
  "q2_cosine": "Q2: on identical batches the two gradients agree to float32 rounding",
  "q3": "Q3: replay's longest prefix does not shrink with R; naive's halves per doubling",
  "cost_model_fit": "Q4: the cost model fits every measured step within 30%",
  "cost_model_prediction": "Q4: by the model the 2.1M-position step fits 8 x H20 with replay",
  "q5": "Q5: GRPO, GSPO, PPO (policy and critic) and DPO steps carry over at P=2048",
  "peer": "replay's step against PrefixGrouper's at full strength at three shapes, timed as a "
  "training run steps (blocks of back-to-back steps, with and without a generation's pause)",
  "verify_tolerance": "the self-check's tolerance: replay vs naive at every step of real runs "
  "(default, tree, SmolLM2 with LoRA in float32 and bf16)",
  "verify_dtype_gap": "why a bf16 run is checked in float32: in bf16 both paths are as far "
  "from the float32 gradient as from each other",
  "long_context": "at long prompts replay's speedup equals its useful-FLOP ratio",
  "idle_step": "the replay step on an idle machine against the matmul rate",
  "sweep": "over 12 shapes replay's CPU speedup is at or above its useful-FLOP ratio",
  "q5_haystack": "every algorithm's step at the haystack task's own shapes",
  "rl_compare": "GRPO, Dr. GRPO, GSPO, RLOO, PPO (two critics) and DPO all learn the task",
  "ppo_haystack": "PPO's ratio moves and its clip binds; the critic's explained variance",
  "tree_bench": "tree replay vs naive on 4 x 4 trees: faster and a third of the memory",
  "auto_tree": "an automatic tree over a shared opening beats flat replay",
  "hybrid_memory": "Gated DeltaNet hybrids: replay's compiled memory below pure attention's",
  "hybrid_speed": "hybrids: replay's CPU speedup above its useful-FLOP ratio",
  "cp_memory": "context parallelism: the shard_map path needs what the GSPMD path needs",
  "plan_8gpu": "the 8-GPU plan: Llama-3-8B at P=131K fits 8 GPUs with parameters over context",
  "cp_cache_sharded": "context parallelism with the cache kept in sequence shards in the tails",
  "cp_key_major": "context parallelism after the tails' per-layer gather, parameters over "
  "fsdp x context and the key-major backward: both memory targets met",
  "plan_8gpu_now": "the 8-GPU plan after the tails' per-layer gather: compiled traffic near "
  "the formula, 131K fits H20/H100/H200",
  "plan_1gpu": "the one-GPU LoRA plan: 8B at 16 x 131,072 compiled by XLA's GPU compiler "
  "for an H200 (no GPU needed): 109.1 GB, within 90% of 141 GB",
}
# Figures the docs show: (claim, the image under experiments/results/, the lines it plots).
FIGURES = {
  "q2_curves": (
    "Q2: reward and loss with 5-seed bands; gradient agreement",
    "q2_cpu_5seeds_2026-11-30.png",
    "q2_cpu_5seeds_2026-11-30.jsonl",
  ),
  "default_run_curve": (
    "the default run's reward and step time",
    "default_run_flat_2026-12-04.png",
    "default_run_flat_2026-12-04.jsonl",
  ),
  "longctx_speed_curve": (
    "long prompts on the real model: seconds per GRPO step against P (ours, naive twin, TRL) "
    "and the speedups beside the useful-FLOP ratio",
    "longctx_speed_cpu_2026-12-07.png",
    "longctx_speed_cpu_2026-12-07.jsonl",
  ),
}
