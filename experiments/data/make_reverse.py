"""Writes experiments/data/reverse.jsonl: 400 "reverse this word" prompts with their answers,
the kind of file a user brings (python experiments/data/make_reverse.py; deterministic).

  {"prompt": "reverse: kqz=", "answer": "zqk"}
"""

import json
import os

import numpy as np

N, LENGTHS = 400, (3, 4, 5)


def main(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "reverse.jsonl")):
  rng = np.random.default_rng(0)
  words = set()
  while len(words) < N:
    n = int(rng.choice(LENGTHS))
    words.add("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=n)))
  with open(path, "w") as f:
    words = sorted(words)
    for i in rng.permutation(len(words)):
      word = words[i]
      f.write(json.dumps({"prompt": f"reverse: {word}=", "answer": word[::-1]}) + "\n")
  return path


if __name__ == "__main__":
  print(main())
