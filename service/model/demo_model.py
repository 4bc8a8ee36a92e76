"""The embedded demo model that ``loadmaster demo`` serves: a ~2M-parameter Llama briefly trained on bundled text.

It is built once (about a minute on two CPU cores) into ``$LOADMASTER_HOME/demo-model`` and reused afterwards; its
greedy output reads vaguely like English, which is enough to see the server work end to end without a model hub.
``python -m service.model.demo_model`` builds it and prints a few continuations from plain transformers.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.user_cache import user_cache_path
from service.model.build_folders import BUILD_FORMAT, atomic_build_dir, check_target, is_complete, write_marker
from service.model.corpus_tokenizer import corpus_text, make_tokenizer, tokenizer_fingerprint
from service.model.random_models import (
    default_shard_size,
    instantiate,
    make_config,
    save_checkpoint,
    set_generation_ids,
    transformers_version,
)

logger = logging.getLogger(__name__)

# The demo model: ~2M parameters, trained for 200 steps (30-80 s on two CPU cores, capped at 90 s).
DEMO_SPEC = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
DEMO_STEPS = 200
DEMO_SEQ_LEN = 96
DEMO_BATCH = 16
DEMO_LR = 3e-3
DEMO_MAX_SECONDS = 90.0


def default_demo_dir() -> Path:
    """Where the demo model lives: ``$LOADMASTER_HOME/demo-model``, else ``$XDG_CACHE_HOME/loadmaster/demo-model``
    (``~/.cache/loadmaster/demo-model``) with loadmaster's other caches."""
    home = os.environ.get("LOADMASTER_HOME")
    return Path(home).expanduser() / "demo-model" if home else user_cache_path("demo-model")


def _training_batches(ids: list[int], bos_id: int, seq_len: int, batch: int, seed: int) -> Callable[[], Any]:
    """Return a sampler of random windows of the corpus, each starting with <s> like a real prompt."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    span = seq_len - 1

    def sample():
        starts = torch.randint(0, len(data) - span, (batch,), generator=gen)
        rows = torch.stack([data[s : s + span] for s in starts.tolist()])
        return torch.cat([torch.full((batch, 1), bos_id, dtype=torch.long), rows], dim=1)

    return sample


def _train_demo(model, tokenizer, steps: int, seed: int, max_seconds: float) -> list[float]:
    """A short AdamW run over the bundled text; stops early (with a warning) if the time budget runs out."""
    import torch

    from loaders.checkpoint.load_progress import progress_bar

    ids = tokenizer(corpus_text(), add_special_tokens=False, verbose=False)["input_ids"]
    sample = _training_batches(ids, tokenizer.bos_token_id, DEMO_SEQ_LEN, DEMO_BATCH, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=DEMO_LR, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    model.train()
    threads_before = torch.get_num_threads()
    threads = _training_threads()
    torch.set_num_threads(threads)
    losses: list[float] = []
    started = time.perf_counter()
    try:
        bar = progress_bar(steps, "training demo model", "steps", logger)
        for step in range(steps):
            batch = sample()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
            if step == 0:
                logger.info("training on %d thread(s)", threads)
            if time.perf_counter() - started > max_seconds and step + 1 < steps:
                logger.warning("demo training hit its %.0f s budget after %d of %d steps", max_seconds, step + 1, steps)
                break
        bar.close()
    finally:
        torch.set_num_threads(threads_before)
    model.eval()
    return losses


def _training_threads() -> int:
    """Threads for demo training: all cores on an idle machine, one on a busy one.

    With other processes on the cores, multi-threaded steps wait on each other's slices and run
    several times slower than a single thread (measured: 1.2 s vs 0.3 s per step on 2 busy cores).
    """
    import torch

    cores = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return 1 if load > 0.5 * (os.cpu_count() or 1) else cores


def build_demo_model(
    out_dir: str | Path | None = None,
    *,
    steps: int = DEMO_STEPS,
    seed: int = 0,
    max_seconds: float = DEMO_MAX_SECONDS,
) -> Path:
    """Build (once) the embedded demo model: a ~2M-parameter Llama briefly trained on the bundled text.

    Takes about a minute on two CPU cores the first time and returns at once afterwards. ``steps`` and
    ``max_seconds`` exist so tests can build a quicker variant; the folder records what was done in
    ``loadmaster_build.json`` (including the first and last training loss).
    """
    out_dir = Path(out_dir).expanduser().resolve() if out_dir is not None else default_demo_dir()
    recipe = dict(
        format=BUILD_FORMAT,
        kind="demo",
        spec=DEMO_SPEC,
        steps=steps,
        seed=seed,
        seq_len=DEMO_SEQ_LEN,
        batch=DEMO_BATCH,
        lr=DEMO_LR,
        tokenizer=tokenizer_fingerprint(),
        transformers=transformers_version(),
    )
    if is_complete(out_dir, recipe):
        return out_dir
    check_target(out_dir)

    import torch

    started = time.perf_counter()
    logger.info("building the demo model into %s (about a minute on 2 CPU cores)", out_dir)
    tokenizer = make_tokenizer()
    config = make_config("llama", DEMO_SPEC, tokenizer, "float32")
    with atomic_build_dir(out_dir) as tmp:
        torch.manual_seed(seed)
        model = instantiate(config, "float32", seed)
        set_generation_ids(model, tokenizer)
        losses = _train_demo(model, tokenizer, steps, seed, max_seconds)
        save_checkpoint(model, tokenizer, tmp, default_shard_size(model, 3))
        write_marker(
            tmp,
            recipe,
            parameters=sum(p.numel() for p in model.parameters()),
            steps_done=len(losses),
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            seconds=round(time.perf_counter() - started, 1),
        )
    logger.info(
        "demo model ready in %.1f s (loss %.2f -> %.2f)",
        time.perf_counter() - started,
        losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"),
    )
    return out_dir


def greedy_sample(model_dir: str | Path, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation of ``prompt`` with plain transformers: a reference the service can be checked against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    """Build the demo model (if needed) and print a few greedy continuations from plain transformers."""
    parser = argparse.ArgumentParser(description="Build loadmaster's demo model and show what it writes.")
    parser.add_argument(
        "--out", type=Path, default=None, help="model folder (default: %(default)s -> $LOADMASTER_HOME/demo-model)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("prompts", nargs="*", default=["The fox", "We hold these truths", "Once a lion"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = build_demo_model(args.out)
    print(f"demo model: {path}")
    for prompt in args.prompts:
        print(f"\n>>> {prompt}")
        print(prompt + greedy_sample(path, prompt, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
