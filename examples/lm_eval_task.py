"""lm-evaluation-harness tasks built from a run's held-out text, to score the run with lm-eval.

    python examples/lm_eval_task.py runs/quickstart --out lm_eval_task [--questions 60] [--seed 0]

lm-eval's own model for a run (looplm/lm_eval.py; the cached engine in this process, no server):

    python -m looplm.lm_eval --model looplm --model_args run=runs/quickstart,batch_size=8 \\
        --tasks looplm_next_bytes,looplm_val_bpb --include_path lm_eval_task

or through `looplm serve` (lm-eval's OpenAI-completions client; `pip install 'lm-eval[api]'`):

    looplm serve runs/quickstart --max-batch 8 &
    lm_eval --model local-completions --tasks looplm_next_bytes,looplm_val_bpb --include_path lm_eval_task \\
        --batch_size 8 --model_args \\
        model=quickstart,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,max_length=128

Two tasks. `looplm_val_bpb` (lm-eval's rolling log-likelihood, as its wikitext task): the
validation split's documents, each cut to `--doc-chars`, scored in windows of `max_length`
tokens, the first token of a document conditioned on the end-of-text token (which the server's
/tokenize gives lm-eval); reports bits_per_byte, byte_perplexity and word_perplexity.
`looplm_next_bytes`: each question is a 60-character context from the run's validation split and four 20-character
continuations: the true one and three spans from elsewhere in the same text (multiple choice;
lm-eval's `acc` picks the likeliest continuation, which favours spans that are likely anywhere,
and `acc_mutual_info` the one the context makes likelier than it is alone). Writes `data.jsonl` and
`looplm_next_bytes.yaml`, `docs.jsonl` and `looplm_val_bpb.yaml` into `--out`. lm-evaluation-harness is not a looplm dependency
(the `lm_eval` extra installs it: `pip install -e '.[lm_eval]'`; add 'lm-eval[api]' for the server path); the data
needs no download.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import looplm
from looplm.data.text import open_tokens

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

ROLLING = """task: looplm_val_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
  - metric: word_perplexity
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


def documents(tokenizer, tokens: list[int]) -> list[str]:
    """A token split's documents (they are separated by the end-of-text token), as text."""
    docs, cur = [], []
    for t in tokens:
        if t == tokenizer.eos_id:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return [tokenizer.decode(d) for d in docs + [cur]]


def ascii_text(text: str) -> str:
    """Whole characters only, whatever the tokenizer: anything outside ASCII becomes a space."""
    return "".join(c if c.isascii() else " " for c in text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--out", default="lm_eval_task")
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--doc-chars", type=int, default=2000, help="characters kept of each validation document")
    args = ap.parse_args()
    run = looplm.load_run(args.run)
    tokens = open_tokens(run.path / "data" / "val.bin").tolist()
    docs = [ascii_text(d)[:args.doc_chars] for d in documents(run.tokenizer, tokens)]
    docs = [d for d in docs if d.strip()]
    text = ascii_text(run.tokenizer.decode(tokens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions(text, args.questions, args.seed)))
    (out / "looplm_next_bytes.yaml").write_text(TASK.format(data=data.resolve()))
    docs_file = out / "docs.jsonl"
    docs_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (out / "looplm_val_bpb.yaml").write_text(ROLLING.format(data=docs_file.resolve()))
    print(f"wrote {data} ({args.questions} questions), {docs_file} ({len(docs)} documents) "
          f"and the tasks looplm_next_bytes, looplm_val_bpb")


if __name__ == "__main__":
    main()
