"""Writes examples/sums.jsonl: the prompts recipes/smollm2_sums.yaml trains SmolLM2-135M-Instruct on.

Each row asks for a sum of two numbers from 1 to 20 and says how to answer:
with the number alone. The answer field is the sum. Every pair appears once,
in an order shuffled with a fixed seed, so the file is the same wherever it is
written: ``python examples/make_sums.py``.
"""

import json
import random
from pathlib import Path

SEED = 0
OUT = Path(__file__).resolve().parent / "sums.jsonl"


def main() -> None:
  pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
  random.Random(SEED).shuffle(pairs)
  with OUT.open("w") as f:
    for a, b in pairs:
      f.write(json.dumps({"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)}) + "\n")


if __name__ == "__main__":
  main()
