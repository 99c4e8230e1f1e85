"""The packaged SmolLM2-135M-Instruct Q4_1 GGUF through models/gguf.py: load time (metadata
parse, dequantization, parameter tree; tokenizer) and greedy answers through our sampler
with its chat template. One JSON line (with provenance) per prompt, after a load line.

  python experiments/gguf_smollm2.py --out=experiments/results/gguf_smollm2_cpu_2026-12-03.jsonl
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_string("out", "", "Append the JSON lines here ('' prints only).")
  flags.DEFINE_multi_string(
    "prompt", ["What is 17 + 25? Answer with just the number."], "User turns (repeatable)."
  )
  flags.DEFINE_integer("max_new_tokens", 32, "Greedy tokens per answer (stops at <|im_end|>).")


FLAGS = flags.FLAGS


def main(argv):
  del argv
  t0 = time.perf_counter()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core import sampler
  from branch_replay.data import tokenizer as tokenizer_lib
  from experiments import provenance
  from models import gguf

  t_import = time.perf_counter() - t0
  path = gguf.smollm2_path()
  t = time.perf_counter()
  gguf.open_file(path)
  t_metadata = time.perf_counter() - t
  t = time.perf_counter()
  cfg, params = gguf.load(path)
  jax.block_until_ready(params)
  t_weights = time.perf_counter() - t
  t = time.perf_counter()
  tok = tokenizer_lib.from_model_dir(path, gguf.read_config(path))
  t_tokenizer = time.perf_counter() - t
  writer = provenance.ResultsWriter(FLAGS.out, "gguf_smollm2")
  writer.write(
    dict(
      what="load",
      file=os.path.basename(path),
      bytes=os.path.getsize(path),
      import_s=round(t_import, 2),
      metadata_s=round(t_metadata, 2),
      weights_s=round(t_weights, 2),
      tokenizer_s=round(t_tokenizer, 2),
      load_total_s=round(t_metadata + t_weights + t_tokenizer, 2),
      n_params=int(sum(x.size for x in jax.tree.leaves(params))),
      model=dict(
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        vocab=cfg.vocab_size,
        tie=cfg.tie_embeddings,
        rope_theta=cfg.rope_theta,
      ),
    )
  )
  for prompt in FLAGS.prompt:
    text, bos = tok.chat_template.render(prompt)
    ids = tok.encode(text, bos=bos)
    t = time.perf_counter()
    s = sampler.sample(
      params,
      cfg,
      sampler.SamplerConfig(max_new_tokens=FLAGS.max_new_tokens, temperature=0.0),
      jnp.asarray([ids], jnp.int32),
      jnp.ones((1, len(ids)), bool),
      jax.random.key(0),
      1,
      stop_tokens=tok.stop_ids,
    )
    out = np.asarray(s.tokens_BRT)[0, 0][np.asarray(s.valid_BRT)[0, 0]]
    writer.write(
      dict(
        what="greedy",
        prompt=prompt,
        prompt_tokens=len(ids),
        answer=tok.decode(out),
        answer_ids=out.tolist(),
        sample_s=round(time.perf_counter() - t, 2),
      )
    )


if __name__ == "__main__":
  define_flags()
  app.run(main)
