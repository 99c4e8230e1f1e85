"""Writes experiments/data/math.jsonl: 200 GSM8K-layout word problems (question; answer text
ending `#### 42`), generated (python experiments/data/make_math.py; deterministic, no
downloads); `--n=1208 --out=experiments/data/math_1208.jsonl` the recipe's larger file. The text uses only the shipped character tokenizer's characters, so the file
trains with it as well as with a checkpoint's BPE. experiments/configs/math_jsonl.py turns a file in
this layout (or GSM8K's own train.jsonl) into k-shot prompts.

  {"question": "Ana has 3 boxes with 7 pens each. She gives away 4 pens. How many pens ...",
   "answer": "Ana has 3*7=21 pens. After giving away 4 she has 21-4=17 pens. #### 17"}
"""

import json
import os

import numpy as np

N = 200
NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Femi", "Gus", "Hana", "Ivan", "Juno")
THINGS = ("pens", "apples", "cards", "books", "shells", "coins", "stamps", "marbles")


def problem(rng):
  name, thing = rng.choice(NAMES), rng.choice(THINGS)
  kind = int(rng.integers(3))
  a, b = int(rng.integers(2, 10)), int(rng.integers(2, 13))
  if kind == 0:
    c = int(rng.integers(1, a * b))
    q = (
      f"{name} has {a} boxes with {b} {thing} each. {name} gives away {c} {thing}. "
      f"How many {thing} are left?"
    )
    s = f"{name} has {a}*{b}={a * b} {thing}. After giving away {c}: {a * b}-{c}={a * b - c}."
    return q, s, a * b - c
  if kind == 1:
    c = int(rng.integers(2, 20))
    q = (
      f"{name} buys {a} packs of {thing} at {b} coins each and pays {c} coins for the bus. "
      f"How many coins does {name} spend?"
    )
    s = f"The packs cost {a}*{b}={a * b} coins. With the bus: {a * b}+{c}={a * b + c} coins."
    return q, s, a * b + c
  total = a * b
  q = (
    f"{name} shares {total} {thing} equally among {a} friends, then each friend gets 2 more. "
    f"How many {thing} does each friend have?"
  )
  s = f"Each friend first gets {total} : {a} = {b}. Then {b}+2={b + 2}."
  return q, s, b + 2


def main(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "math.jsonl"), count=N):
  """The first `count` distinct problems of seed 0 (a larger count extends the same sequence: the
  1,208-problem file experiments/configs/math_smollm2.py reads starts with math.jsonl's 200)."""
  rng = np.random.default_rng(0)
  seen, rows = set(), []
  while len(rows) < count:
    q, s, n = problem(rng)
    if q not in seen:
      seen.add(q)
      rows.append({"question": q, "answer": f"{s} #### {n}"})
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return path


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--n", type=int, default=N, help="problems")
  parser.add_argument("--out", default="", help="default: experiments/data/math.jsonl")
  args = parser.parse_args()
  print(main(args.out, args.n) if args.out else main(count=args.n))
