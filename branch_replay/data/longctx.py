"""Long-context retrieval tasks in the model's own tokens, generated offline (RULER's synthetic
pair): `needle` (multi-key needle retrieval) and `vartrack` (variable tracking).

  needle    K lines "The special number for <key> is <7 digits>." hidden at random depths in
            filler; the question asks for one key's number. Reward `needle_number`: 1 when the
            completion's first number is that number, else 0.
  vartrack  chains `VAR QKZTP = 12345.`, `VAR BRWXA = VAR QKZTP.`, ... of `hops` assignments,
            beside `distractors` chains of other values; the question asks which variables
            hold one value. Reward `variable_set`: 1 when the set of 5-letter uppercase names
            in the completion is exactly the chain's (with reward_options partial: their
            Jaccard overlap |got & want| / |got | want|).

The filler is a fixed list of sentences drawn with the task's numpy Generator, added whole
until one more would pass `task.prompt_len` tokens (BOS and the chat template included): a
prompt is at most prompt_len tokens and short of it by less than one sentence. A line's depth
is the fraction of the filler's tokens before it. Every character is in the character
tokenizer's alphabet, so the tasks also run on the shipped small model. Held-out prompts
(`eval_examples`) are those whose answer's CRC-32 is 0 mod 10; training prompts never are:
the two splits share no prompt.
"""

from __future__ import annotations

import dataclasses
import re
import string
import zlib

import numpy as np

from branch_replay.data import rewards
from branch_replay.data.tasks import Example, Task, register
from branch_replay.data.tokenizer import TOKENIZER

SENTENCES = (
  "The grass in the valley was green after the long rain.",
  "A small boat drifted slowly along the quiet river.",
  "Most of the town was asleep when the bells rang at dawn.",
  "The old library kept its maps in a cold room under the stairs.",
  "Farmers in the north plant barley late in the spring.",
  "The train to the coast stops at every village on the way.",
  "Clouds gathered over the hills, but no storm came.",
  "She painted the fence white and left the gate open.",
  "The market sells bread, cheese and fresh fish on Fridays.",
  "A narrow path climbs from the harbor to the lighthouse.",
  "Children played in the square until the lamps were lit.",
  "The museum has a collection of clocks from many centuries.",
  "Snow covered the roofs, and smoke rose from every chimney.",
  "The baker starts work long before the sun comes up.",
  "Wind from the sea carries the smell of salt into the streets.",
  "An old bridge of grey stone crosses the river near the mill.",
  "The garden behind the house is full of roses and tall weeds.",
  "Birds nest in the tower of the church every summer.",
  "The road along the lake is closed in the winter months.",
  "He read the newspaper slowly while his coffee grew cold.",
  "The festival brings music and dancing to the town each autumn.",
  "A quiet forest of pine trees lies to the east of the farm.",
  "The teacher wrote the date on the board and opened the window.",
  "Boats return to the harbor in the evening with their catch.",
  "The hotel on the hill has a view of the whole bay.",
  "Rain fell all night, and the streams ran fast in the morning.",
  "The shop on the corner repairs shoes, bags and umbrellas.",
  "In the evening the hills turn gold and then dark blue.",
  "The workers built a new wall around the orchard.",
  "A cat slept on the warm steps in front of the post office.",
  "The river floods the lower fields every few years.",
  "Visitors often stop to take pictures of the old windmill.",
  "The mountain road has many sharp turns and few railings.",
  "Every house on the street has a small garden in front.",
  "The ferry crosses the strait four times a day in summer.",
  "Leaves fell from the oaks and covered the park in brown.",
  "The village well has been dry for many years.",
  "A long table stood in the middle of the kitchen.",
  "The fishermen mended their nets on the stone pier.",
  "Music from the radio drifted out of an open window.",
  "The castle ruins are visited by a few travelers each week.",
  "The meadow was full of yellow flowers in early June.",
  "The clock in the hall stopped at a quarter past nine.",
  "Heavy carts once carried grain along this road to the city.",
  "The pond behind the school freezes in cold winters.",
  "A row of poplars marks the edge of the old estate.",
  "The doctor visits the farms in the valley once a month.",
  "Fog rolled in from the sea and hid the harbor lights.",
  "The cellar was full of apples stored for the winter.",
  "Sheep graze on the slopes above the village all summer.",
  "The bookshop sells old novels, atlases and postcards.",
  "A stone wall divides the two fields near the crossroads.",
  "The bus to the market leaves at seven in the morning.",
  "The sky cleared in the afternoon and the wind dropped.",
  "The miller ground wheat and rye for the whole district.",
  "Lanterns hung from the trees along the main street.",
  "The island can be reached by boat at low tide.",
  "The orchard produces pears, plums and a few cherries.",
  "A wooden bench faces the lake at the end of the path.",
  "The town hall was built of red brick two centuries ago.",
  "Swallows fly low over the fields before a storm.",
  "The bakery window was full of bread and small cakes.",
  "The hills to the south are covered with vineyards.",
  "A quiet lane leads from the church to the cemetery.",
)

KEYS = (
  "apple", "river", "candle", "falcon", "harbor", "lantern", "meadow", "orchid", "pebble",
  "quartz", "saddle", "thistle", "violet", "walnut", "anchor", "bramble", "cactus", "dolphin",
  "ember", "fossil", "glacier", "hazel", "island", "jasmine", "kettle", "lemon", "marble",
  "nutmeg", "otter", "pepper", "quill", "raven", "sparrow", "tulip", "umber", "velvet",
  "willow", "yarrow", "zephyr", "acorn", "beacon", "cobalt", "dune", "eagle", "fern", "garnet",
  "heron", "ivory", "juniper", "kestrel", "lotus", "maple", "nectar", "onyx", "plume",
  "ripple", "saffron", "timber", "cedar", "badger", "copper", "dragon", "feather", "ginger",
)  # fmt: skip

HELD_OUT_MOD = 10  # held out: crc32(answer) % 10 == 0
CHAT_TEMPLATE = ("auto", "none")
_NUMBER = re.compile(r"\d+(?:,\d{3})*")
_NAME = re.compile(r"\b[A-Z]{5}\b")


def held_out(answer: str) -> bool:
  return zlib.crc32(answer.encode()) % HELD_OUT_MOD == 0


def first_number(text: str):
  """The first run of digits in `text` (commas between groups of three dropped), or None."""
  match = _NUMBER.search(text)
  return match.group().replace(",", "") if match else None


@rewards.register("needle_number", needs=("answer",))
def needle_number(examples, completions):
  """1 when the completion's first number (`first_number`) is the answer's, else 0."""
  return [
    float(first_number(c) is not None and first_number(c) == first_number(e.answer))
    for e, c in zip(examples, completions)
  ]


@rewards.register("variable_set", needs=("answer",))
def variable_set(examples, completions, *, partial: bool = False):
  """1 when the 5-letter uppercase names in the completion are exactly the answer's (order,
  repeats, `VAR`, commas and `and` do not matter), else 0; partial=True: |got & want| /
  |got | want| (the Jaccard overlap: a missing and an extra name each cost)."""
  out = []
  for e, c in zip(examples, completions):
    want, got = set(_NAME.findall(e.answer)), set(_NAME.findall(c))
    out.append(len(want & got) / len(want | got) if partial else float(got == want))
  return out


def _positive(name: str, value, low: int = 1, high: int | None = None):
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"task.{name}={value!r}: expected an int >= {low}")
  if high is not None and value > high:
    raise ValueError(f"task.{name}={value!r}: expected an int <= {high}")


def _bool(name: str, value):
  if not isinstance(value, bool):
    raise ValueError(f"task.{name}={value!r}: expected a bool")


@dataclasses.dataclass(frozen=True)
class Drawn:
  """One problem before the filler: its text around the hidden lines, and its answer."""

  intro: str
  lines: list  # the hidden lines
  question: str
  prefix: str  # the opening of the answer (task.answer_prefix)
  answer: str  # the canonical completion after the prefix
  fields: dict
  chains: list = dataclasses.field(default_factory=list)  # indices of lines kept in order


class LongContextTask(Task):
  """What both tasks share: the prompt assembled to `prompt_len` tokens around hidden lines,
  the splits, the answer length. A subclass draws its lines (`_draw`)."""

  answer_chars = 0  # the longest answer's characters

  def __init__(self, cfg, tokenizer=TOKENIZER):
    super().__init__(cfg, tokenizer)
    if cfg.chat_template not in CHAT_TEMPLATE:
      raise ValueError(f"task.chat_template={cfg.chat_template!r}: expected one of {CHAT_TEMPLATE}")
    template = getattr(tokenizer, "chat_template", None)
    self.template = template if cfg.chat_template == "auto" else None
    self.sentence_tokens = np.asarray([len(tokenizer.encode(" " + s)) for s in SENTENCES])
    self.max_prompt_len = self.sft_prompt_len = cfg.prompt_len
    rng = np.random.default_rng(0)
    drawn = [self._draw(rng) for _ in range(8)]
    bare = max(len(self._ids(d.intro, d.lines, d.question, d.prefix)) for d in drawn)
    need = bare + 2 * int(self.sentence_tokens.max())  # room for the draws' spread
    if cfg.prompt_len < need:
      raise ValueError(
        f"task.prompt_len={cfg.prompt_len}: expected >= {need} tokens (the instructions, "
        f"the hidden lines and the question take up to {bare}, plus filler)"
      )
    # An ASCII answer is at most one token a character (a byte-level BPE or characters).
    self.max_answer_len = self.answer_chars
    self.sft_tail_len = self.max_answer_len + 1  # EOS

  # the prompt

  def _ids(self, intro: str, pieces: list, question: str, prefix: str) -> list:
    """BOS + the user turn (through the chat template, when there is one) + the opening of
    the answer (task.answer_prefix)."""
    user = " ".join([intro, *pieces, question])
    prefix = prefix if self.cfg.answer_prefix else ""
    if self.template is None:
      text = user + " Answer:" + (" " + prefix if prefix else "")
      return [self.tokenizer.bos_id] + self.tokenizer.encode(text)
    text, bos = self.template.render(user)
    return ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(text + prefix)

  def _compose(self, rng, drawn: Drawn, depths: list):
    """(prompt ids, the user turn's pieces, realised depths): filler sentences drawn from `rng` added
    whole while the prompt fits prompt_len; line i placed at the sentence boundary whose
    share of the filler's tokens before it is nearest depths[i]."""
    target, lines = self.cfg.prompt_len, drawn.lines
    cap = target // int(self.sentence_tokens.min()) + 1
    order_N = rng.integers(len(SENTENCES), size=cap)
    cum_N = np.concatenate([[0], np.cumsum(self.sentence_tokens[order_N])])
    by_depth = sorted(range(len(lines)), key=lambda i: depths[i])  # stable: chains keep order

    def build(n: int):
      at = [int(np.argmin(np.abs(cum_N[: n + 1] - d * cum_N[n]))) for d in depths]
      pieces, k = [], 0
      for j in range(n + 1):
        while k < len(by_depth) and at[by_depth[k]] == j:
          pieces.append(lines[by_depth[k]])
          k += 1
        if j < n:
          pieces.append(SENTENCES[order_N[j]])
      ids = self._ids(drawn.intro, pieces, drawn.question, drawn.prefix)
      return ids, pieces, [float(cum_N[a] / max(cum_N[n], 1)) for a in at]

    got = build(0)
    if len(got[0]) > target:
      raise ValueError(f"task.prompt_len={target}: a prompt without filler is {len(got[0])} tokens")
    n = int(np.searchsorted(cum_N, target - len(got[0]), side="right")) - 1  # additive guess
    n = min(max(n, 0), cap - 1)
    got = build(n)
    while len(got[0]) > target:  # tokens merged across a boundary: step back
      n -= 1
      got = build(n)
    while n < cap:
      more = build(n + 1)
      if len(more[0]) > target:
        break
      n, got = n + 1, more
    return got

  # the protocol

  def _example(self, rng, held: bool) -> Example:
    drawn = self._draw(rng)
    while held_out(drawn.answer) != held:
      drawn = self._draw(rng)
    depths = [float(d) for d in rng.random(len(drawn.lines))]
    for chain in drawn.chains:  # a chain's lines in order
      for i, d in zip(chain, sorted(depths[i] for i in chain)):
        depths[i] = d
    ids, pieces, realised = self._compose(rng, drawn, depths)
    fields = dict(
      drawn.fields,
      answer=drawn.answer,
      intro=drawn.intro,
      question=drawn.question,
      lines=drawn.lines,
      target_depths=depths,
      depths=realised,
      n_filler=len(pieces) - len(drawn.lines),
    )
    user = " ".join([drawn.intro, *pieces, drawn.question])
    return Example(user, drawn.answer, fields=fields, prompt_ids=tuple(ids))

  def sample(self, rng: np.random.Generator) -> Example:
    return self._example(rng, held=False)

  def eval_examples(self, seed: int, n: int) -> list:
    rng = np.random.default_rng([seed, 2**31])  # a stream the training steps never use
    return [self._example(rng, held=True) for _ in range(n)]

  def check(self, cfg) -> None:
    if self.max_answer_len + 1 > cfg.sampler.max_new_tokens:
      raise ValueError(
        f"sampler.max_new_tokens={cfg.sampler.max_new_tokens}: expected >= "
        f"{self.max_answer_len + 1} (the task's longest answer + EOS)"
      )


@register("needle")
class Needle(LongContextTask):
  """Multi-key needle retrieval: which number belongs to one of `n_keys` keys."""

  reward_name = "needle_number"

  @dataclasses.dataclass(frozen=True)
  class Options:
    prompt_len: int = 2048  # prompt tokens (BOS and chat template included); filled to it
    n_keys: int = 4  # needles hidden (the question asks for one)
    chat_template: str = "auto"  # auto (the tokenizer's, when it has one) | none
    answer_prefix: bool = True  # the answer starts "The special number for <key> is"

    def __post_init__(self):
      _positive("prompt_len", self.prompt_len, 16)
      _positive("n_keys", self.n_keys, 1, len(KEYS))
      _bool("answer_prefix", self.answer_prefix)

  answer_chars = len(" 1234567.")

  def _draw(self, rng) -> Drawn:
    K = self.cfg.n_keys
    keys = [KEYS[i] for i in rng.choice(len(KEYS), size=K, replace=False)]
    values = [str(v) for v in rng.choice(9_000_000, size=K, replace=False) + 1_000_000]
    ask = int(rng.integers(K))
    return Drawn(
      intro=(
        "Some special numbers are hidden in the following text. Remember them: I will ask "
        f"for one of them. There are {K} of them."
      ),
      lines=[f"The special number for {k} is {v}." for k, v in zip(keys, values)],
      question=f"What is the special number for {keys[ask]} mentioned in the text?",
      prefix=f"The special number for {keys[ask]} is",
      answer=f" {values[ask]}.",
      fields=dict(key=keys[ask], keys=keys, values=values),
    )


@register("vartrack")
class VarTrack(LongContextTask):
  """Variable tracking: which variables a chain of `hops` assignments gives one value."""

  reward_name = "variable_set"

  @dataclasses.dataclass(frozen=True)
  class Options:
    prompt_len: int = 2048  # prompt tokens (BOS and chat template included); filled to it
    hops: int = 2  # assignments `VAR X = VAR Y.` after the chain's `VAR Y = 12345.` (1-4)
    distractors: int = 1  # other chains (same hops, other values and names), 0-8
    chat_template: str = "auto"
    answer_prefix: bool = True  # the answer starts "The variables that hold <value> are:"
    partial_credit: bool = False  # the names' Jaccard overlap instead of 0/1

    def __post_init__(self):
      _positive("prompt_len", self.prompt_len, 16)
      _positive("hops", self.hops, 1, 4)
      _positive("distractors", self.distractors, 0, 8)
      _bool("answer_prefix", self.answer_prefix)
      _bool("partial_credit", self.partial_credit)

  def __init__(self, cfg, tokenizer=TOKENIZER):
    self.answer_chars = 1 + 5 * (cfg.hops + 1) + 2 * cfg.hops  # " AAAAA, BBBBB, ..."
    super().__init__(cfg, tokenizer)
    self.reward_options = {"partial": cfg.partial_credit}

  def _draw(self, rng) -> Drawn:
    C, V = 1 + self.cfg.distractors, self.cfg.hops + 1  # chains, variables per chain
    names = []
    while len(names) < C * V:
      name = "".join(rng.choice(list(string.ascii_uppercase), size=5))
      names += [name] if name not in names else []
    values = [str(v) for v in rng.choice(90_000, size=C, replace=False) + 10_000]
    lines, chains = [], []
    for c in range(C):
      chain = names[c * V : (c + 1) * V]
      chains.append(list(range(len(lines), len(lines) + V)))
      lines.append(f"VAR {chain[0]} = {values[c]}.")
      lines += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
    ask = int(rng.integers(C))
    want = names[ask * V : (ask + 1) * V]
    return Drawn(
      intro="Memorize and track the chains of variable assignments hidden in the following text.",
      lines=lines,
      question=f"Which variables are assigned the value {values[ask]} in the text above?",
      prefix=f"The variables that hold {values[ask]} are:",
      answer=" " + ", ".join(want),
      fields=dict(value=values[ask], names=want),
      chains=chains,
    )
