"""A ShareGPT-format workload cut from tiny shakespeare, the corpus the bundled models were trained on.

Each row: 400 characters starting after a blank line as the prompt, the next 400 characters as the
completion (bench uses its token count as the output length). Used by the speculative-decoding benchmarks.

    python scripts/make_shakespeare_dataset.py ../shared/data/tinyshakespeare.txt runs/sd/shakespeare1200.json
"""
import argparse
import json
import random


def passages(text: str, num_rows: int, chars: int, seed: int) -> list[dict]:
    starts = [i + 2 for i in range(len(text) - 2 * chars - 2) if text[i:i + 2] == "\n\n"]
    picked = random.Random(seed).sample(starts, num_rows)
    return [{"conversations": [{"from": "human", "value": text[s:s + chars]},
                               {"from": "gpt", "value": text[s + chars:s + 2 * chars]}]} for s in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("out")
    parser.add_argument("--num-rows", type=int, default=1200)
    parser.add_argument("--chars", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with open(args.corpus) as f:
        rows = passages(f.read(), args.num_rows, args.chars, args.seed)
    with open(args.out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
