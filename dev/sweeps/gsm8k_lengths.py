"""Write data/workloads/gsm8k_lengths.json: the distribution of GSM8K worked-solution lengths in tokens.

The variable-length rollout workload (`bench/workloads.py`) draws completion lengths from this
distribution, scaled so its longest solution maps to the benchmark's generation limit. Source:
GSM8K train split (MIT), the `answer` field, tokenized with the embedded model's tokenizer
(SmolLM2-135M-Instruct, a byte-level BPE). Run: python dev/sweeps/gsm8k_lengths.py PATH/train.jsonl
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402
from qerl_lib.models.embedded import prepare_embedded_model  # noqa: E402

source = Path(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(prepare_embedded_model())
lengths = sorted(len(tokenizer(json.loads(line)["answer"], add_special_tokens=False)["input_ids"])
                 for line in source.read_text().splitlines() if line.strip())
n = len(lengths)
percentiles = list(range(0, 101))
quantiles = [lengths[min(n - 1, round(p / 100 * (n - 1)))] for p in percentiles]
record = {"what": "GSM8K train worked-solution lengths (tokens, SmolLM2 tokenizer): value at each percentile 0..100",
          "source": "GSM8K (MIT), train.jsonl, field 'answer'", "n": n, "percentiles": percentiles,
          "tokens": quantiles, "mean": sum(lengths) / n,
          "provenance": provenance(command="python dev/sweeps/gsm8k_lengths.py ../shared/data/gsm8k/train.jsonl")}
write_json_atomic(Path(__file__).resolve().parents[2] / "data" / "workloads" / "gsm8k_lengths.json", record)
print(f"n={n} mean={record['mean']:.1f} median={quantiles[50]} p90={quantiles[90]} max={quantiles[100]}")
