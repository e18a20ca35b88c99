"""lm-eval against a running pdserve, checked with transformers on the same token ids.

    pdserve up --detach                 # the built-in default model, OpenAI API on :8000
    python tools/lm_eval_check.py --lm-eval /path/to/venv/bin/lm_eval [--batch-size 32]

lm-eval (``pip install "lm_eval[api]"``, in a venv of its own: it pins other versions than the
tests) runs a small multiple-choice task over Python snippets through its ``local-completions``
model, the loglikelihood calls scoring clients make (token ids, ``echo``, ``logprobs: 1``,
``max_tokens: 1``). Each choice's log-likelihood and greedy flag in its samples are then computed
again with transformers from the token ids lm-eval sent, and the largest difference is printed:
what pdserve answers is what the model computes, as lm-eval reads it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.default_model_path import DEFAULT_MODEL_PATH

DOCS = [
    ("import", ["os", "banana", "12345"]),
    ("def __init__(self", ["):", "]]", "!!"]),
    ("for i in", [" range(", " banana(", " 7 7"]),
    ("return", [" self", " }}}", " ;;"]),
    ("class Foo", ["(object):", "=====", "[[[["]),
    ("if __name__ ==", [" '__main__':", " 42 42", " import"]),
    ("    raise", [" ValueError(", " 3.14", " ))"]),
    ("from collections import", [" OrderedDict", " 999", " ]]"]),
    ("try:\n    x = 1\nexcept", [" Exception:", " 77", " ((("]),
    ("with open(path) as", [" f:", " 5", " ]"]),
    ("self.assertEqual(", ["a, b)", "]]]", "###"]),
    ("    def", [" __repr__(self):", " 0000", " ;;;;"]),
]

TASK = """task: pdscore
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1/completions")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH, help="the served model's directory")
    parser.add_argument("--name", default=None, help="the served model name (default: the directory's name)")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "data.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n" for q, c in DOCS))
        (work / "pdscore.yaml").write_text(TASK.format(data=work / "data.jsonl"))
        model_args = (
            f"model={args.name or args.model.name},base_url={args.base_url},tokenizer={args.model},"
            "tokenized_requests=True,num_concurrent=1,max_retries=1"
        )
        subprocess.run(
            [args.lm_eval, "--model", "local-completions", "--model_args", model_args, "--batch_size", str(args.batch_size),
             "--tasks", "pdscore", "--include_path", str(work), "--log_samples", "--output_path", str(work / "out")],
            check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        )
        (samples,) = glob.glob(str(work / "out" / "**" / "samples_pdscore_*.jsonl"), recursive=True)
        print(_compare(Path(samples), args.model))


def _compare(samples: Path, model_dir: Path) -> str:
    """The largest |log-likelihood| difference and whether every greedy flag agrees."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731  (as lm-eval's API models encode)
    worst, count, greedy_agrees = 0.0, 0, True
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for arguments, response in zip(sample["arguments"].values(), sample["resps"]):
            context, whole = encode(arguments["arg_0"]), encode(arguments["arg_0"] + arguments["arg_1"])
            continuation = whole[len(context):]
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            rows = [log_probs[len(context) - 1 + i] for i in range(len(continuation))]
            loglikelihood = sum(row[token].item() for row, token in zip(rows, continuation))
            greedy = all(int(row.argmax()) == token for row, token in zip(rows, continuation))
            worst = max(worst, abs(loglikelihood - float(response[0][0])))
            greedy_agrees &= str(greedy) == response[0][1]
            count += 1
    return f"{count} choices: max |pdserve - transformers| log-likelihood {worst:.2e}; greedy flags agree: {greedy_agrees}"


if __name__ == "__main__":
    main()
