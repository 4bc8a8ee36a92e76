"""The batched sampler against choosing row by row: the same :func:`service.engine.sampling.choose_batch`, called once
for a batch of B rows or B times for one row each (what the engine did before: one chooser call per sequence).

Rows mix the settings a real batch holds: greedy, temperature + top-p, top-k, penalties. Vocabulary 32,000 (a
Llama's). Times are the best of ``--repeats`` runs of ``--steps`` steps, in one process, side by side.

Run: ``.venv/bin/python -m bench.sampling [--batches 1,8,32] [--steps 20] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, print_table
from service.engine.sampling import SamplingParams, TokenChooser, choose_batch

VOCAB = 32_000
MIX = [
    SamplingParams(),
    SamplingParams(do_sample=True, temperature=0.8, top_p=0.9),
    SamplingParams(do_sample=True, top_k=40),
    SamplingParams(do_sample=True, temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.5),
]


def _choosers(batch: int) -> list[TokenChooser]:
    return [
        TokenChooser.create(SamplingParams(**{**MIX[r % len(MIX)].__dict__, "seed": r}), prompt_ids=range(32))
        for r in range(batch)
    ]


def _time(batch: int, steps: int, batched: bool) -> float:
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    choosers = _choosers(batch)
    start = time.perf_counter()
    for _ in range(steps):
        if batched:
            picks = choose_batch(logits, choosers)
        else:
            picks = [choosers[r].choose(logits[r]) for r in range(batch)]
        for c, p in zip(choosers, picks):
            c.accept(p.token)
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(machine())
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rowwise = min(_time(batch, args.steps, batched=False) for _ in range(args.repeats))
        batched = min(_time(batch, args.steps, batched=True) for _ in range(args.repeats))
        rows.append(
            {
                "batch": batch,
                "rowwise_ms": rowwise * 1e3,
                "batched_ms": batched * 1e3,
                "speedup": rowwise / batched,
            }
        )
    print_table(
        rows,
        [("batch", "B"), ("rowwise_ms", "row by row (ms/step)"), ("batched_ms", "batched (ms/step)"), ("speedup", "x")],
    )


if __name__ == "__main__":
    main()
