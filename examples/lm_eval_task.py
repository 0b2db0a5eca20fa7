"""An lm-evaluation-harness task built from a run's held-out text, to score the run through `looplm serve`.

    python examples/lm_eval_task.py runs/quickstart --out lm_eval_task [--questions 60] [--seed 0]
    looplm serve runs/quickstart --max-batch 8 &
    lm_eval --model local-completions --tasks looplm_next_bytes --include_path lm_eval_task --batch_size 8 \\
        --model_args model=quickstart,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,max_length=128

Each question is a 60-character context from the run's validation split and four 20-character
continuations: the true one and three spans from elsewhere in the same text (multiple choice;
lm-eval's `acc` picks the likeliest continuation, which favours spans that are likely anywhere,
and `acc_mutual_info` the one the context makes likelier than it is alone). Writes `data.jsonl` and
`looplm_next_bytes.yaml` into `--out`. lm-evaluation-harness is not a looplm dependency
(`pip install 'lm-eval[api]'` where you run it); the data needs no download.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import looplm
from looplm.data import open_tokens

TASK = """task: looplm_next_bytes
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_mutual_info
    aggregation: mean
    higher_is_better: true
"""


def questions(text: str, n: int, seed: int) -> list[dict]:
    """n multiple-choice questions: a 60-character context, the true next 20 characters among
    three 20-character spans from elsewhere, in random order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randrange(0, len(text) - 80)
        context, true = text[p:p + 60], text[p + 60:p + 80]
        others: list[str] = []
        while len(others) < 3:
            q = rng.randrange(0, len(text) - 20)
            if text[q:q + 20] != true:
                others.append(text[q:q + 20])
        choices = others + [true]
        rng.shuffle(choices)
        out.append({"context": context, "choices": choices, "label": choices.index(true)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--out", default="lm_eval_task")
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run = looplm.load_run(args.run)
    text = run.tokenizer.decode(open_tokens(run.path / "data" / "val.bin").tolist())
    text = "".join(c if c.isascii() else " " for c in text)       # whole characters only, whatever the tokenizer
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions(text, args.questions, args.seed)))
    (out / "looplm_next_bytes.yaml").write_text(TASK.format(data=data.resolve()))
    print(f"wrote {data} ({args.questions} questions) and {out / 'looplm_next_bytes.yaml'}")


if __name__ == "__main__":
    main()
