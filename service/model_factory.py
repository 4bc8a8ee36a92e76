"""Build small, real transformers models offline: test fixtures, benchmark models and the demo model.

Everything here works without a network or a model hub. The tokenizer is a byte-level BPE trained in
well under a second on the public-domain text bundled in ``service/data``; models are real transformers
classes (Llama, GPT-2, Mixtral) with random weights from a fixed seed, saved by ``save_pretrained`` as
*sharded* safetensors with an index, exactly as a downloaded checkpoint would look. The demo model is a
small Llama briefly trained on the same text so its greedy output reads vaguely like English.

Builds are atomic (written to a temporary sibling folder, then renamed) and cached: a folder that already
holds a complete build from the same arguments is reused, so tests and benchmarks can call these freely.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
MARKER_NAME = "loadmaster_build.json"
BUILD_FORMAT = 2  # bump when builds change meaning, so cached folders are rebuilt
STALE_AFTER_S = 3600.0  # a temporary build folder this old belongs to a crashed build

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0..3, in this order
TOKENIZER_VOCAB = 1024

# A plain chat format the tiny models can follow: one header line per turn, each turn closed by </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('chat roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '### ' + message['role'] + ':\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)

DTYPES = ("float32", "float16", "bfloat16")

# Architecture sizes per (kind, size). Kept as plain kwargs so a reader sees the whole model at a glance.
MODEL_SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama", "tiny"): dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024,
    ),
    ("llama", "100m"): dict(
        hidden_size=768, intermediate_size=2560, num_hidden_layers=14, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=4096,
    ),
    ("llama", "1b"): dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=4096,
    ),
    ("gpt2", "tiny"): dict(n_embd=64, n_layer=4, n_head=4, n_positions=1024),
    ("mixtral", "tiny"): dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
    ),
}

# How many shards a default build aims for: even tiny models must exercise the sharded-index path.
TARGET_SHARDS = {"tiny": 3, "100m": 4, "1b": 5}

# The demo model: ~2M parameters, trained for 200 steps (30-80 s on two CPU cores, capped at 90 s).
DEMO_SPEC = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=1024,
)
DEMO_STEPS = 200
DEMO_SEQ_LEN = 96
DEMO_BATCH = 16
DEMO_LR = 3e-3
DEMO_MAX_SECONDS = 90.0


# --------------------------------------------------------------------------------------------- text


def corpus_text() -> str:
    """The bundled public-domain text, all files joined in a fixed order."""
    files = sorted(DATA_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(
            f"no bundled text found in {DATA_DIR}; reinstall loadmaster so its package data is present"
        )
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files) + "\n"


# ---------------------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process; the JSON form is cached so callers get fresh copies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Paragraphs as training units keep merges from spanning blank lines; order is fixed -> deterministic.
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok.to_str()


def tokenizer_fingerprint() -> str:
    """Short hash of the tokenizer, recorded in build markers so a changed corpus invalidates caches."""
    return hashlib.sha256(_tokenizer_json().encode("utf-8")).hexdigest()[:16]


def make_tokenizer():
    """A deterministic byte-level BPE tokenizer (~1k tokens) with <s>, </s>, <pad>, <unk> and a chat template.

    Encoding adds ``<s>`` in front (like Llama tokenizers). Returns a new
    ``transformers.PreTrainedTokenizerFast`` on every call, so callers may modify it freely.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=1024,
        padding_side="left",  # decoder-only batches are left-padded for generation
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def padded_vocab_size(tokenizer_len: int, multiple: int = 8) -> int:
    """Embedding rows for a tokenizer of this length, rounded up so matrix shapes stay friendly."""
    return int(math.ceil(tokenizer_len / multiple) * multiple)


# ------------------------------------------------------------------------------------ build caching


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _is_complete(directory: Path, recipe: dict[str, Any]) -> bool:
    marker = _read_marker(directory)
    return marker is not None and marker.get("recipe") == recipe


@contextmanager
def _atomic_build_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success it is renamed into place, on failure removed.

    Builds write into the temporary folder and finish by writing the marker, so ``out_dir`` is either
    absent or complete. If another process finished first, its (identical) build is kept.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        _make_shareable(tmp)
        _install(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_leftovers(out_dir: Path, max_age_s: float = STALE_AFTER_S) -> None:
    """Delete temporary folders that crashed builds of ``out_dir`` left behind long ago."""
    now = time.time()
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            try:
                if now - leftover.stat().st_mtime > max_age_s:
                    logger.info("removing stale build leftover %s", leftover)
                    shutil.rmtree(leftover, ignore_errors=True)
            except FileNotFoundError:
                pass


def _make_shareable(directory: Path) -> None:
    """Give the build ordinary permissions (mkdtemp and atomic shard writes use owner-only modes)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _install(tmp: Path, out_dir: Path) -> None:
    recipe = (_read_marker(tmp) or {}).get("recipe")
    if out_dir.exists() and _read_marker(out_dir) is not None and not _is_complete(out_dir, recipe):
        # A stale build of ours with other arguments: move it aside, then replace it.
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, trash / "build")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)  # replaces a missing or empty folder atomically
    except OSError:
        if _is_complete(out_dir, recipe):
            logger.info("another process finished %s first; keeping its build", out_dir)
            return
        raise


def _check_target(out_dir: Path) -> None:
    """Refuse to overwrite a folder that holds something other than a build of ours."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and _read_marker(out_dir) is None:
        raise FileExistsError(
            f"{out_dir} is not empty and was not built by loadmaster (no {MARKER_NAME}); "
            "choose an empty or new folder, or remove it first"
        )


def _write_marker(directory: Path, recipe: dict[str, Any], **extra: Any) -> None:
    payload = {"format": BUILD_FORMAT, "recipe": recipe, **extra}
    (directory / MARKER_NAME).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------- models


def _transformers_version() -> str:
    """Recorded in build markers (read from metadata, so a cache hit never imports transformers)."""
    return importlib.metadata.version("transformers")


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _make_config(kind: str, spec: dict[str, Any], tokenizer, dtype: str):
    """The transformers config for ``kind`` with vocab and special-token ids taken from the tokenizer."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vocab = padded_vocab_size(len(tokenizer))
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    elif kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, tie_word_embeddings=True, **ids, **spec)
    elif kind == "mixtral":
        cfg = MixtralConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    else:  # pragma: no cover - callers validate kind first
        raise ValueError(kind)
    cfg.dtype = dtype
    return cfg


def _init_weights_(model, seed: int, std: float = 0.02) -> None:
    """Fill every parameter in place from one seeded generator: fast, and byte-identical for a seed.

    Norm scales (1-D weights) become ones, biases zeros, everything else N(0, std). Walking
    ``named_parameters`` in order (tied weights appear once) makes the result independent of how
    transformers would have initialised the model.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)


def _fix_buffers_(model) -> None:
    """Recompute the buffers (rotary frequencies) that ``to_empty`` left as uninitialised memory.

    Each buffer-owning module is rebuilt from its config on the CPU and its buffers copied over; a
    module that cannot be rebuilt that way is an error rather than silently carrying garbage.
    """
    import torch

    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise RuntimeError(
                f"cannot initialise buffers {sorted(own)} of {name or 'the model'} ({type(module).__name__}); "
                "model_factory only knows config-built buffer modules such as rotary embeddings"
            )
        with torch.device("cpu"):
            fresh = type(module)(config)
        with torch.no_grad():
            for key, buf in own.items():
                buf.copy_(getattr(fresh, key))
        for attr, value in vars(fresh).items():  # plain attributes computed with the buffers (e.g. scaling)
            if not attr.startswith("_") and isinstance(value, (int, float)):
                setattr(module, attr, value)


def _instantiate(config, dtype: str, seed: int):
    """Build the model on the meta device, allocate it on the CPU and fill it: no slow default init."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    # to_empty gives shared parameters separate storage; re-tie before filling so tied weights stay one tensor.
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _init_weights_(model, seed)
    _fix_buffers_(model)
    model.eval()
    return model


def _set_generation_ids(model, tokenizer) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _default_shard_size(model, target_shards: int) -> int:
    """Bytes per shard so the checkpoint splits into about ``target_shards`` files."""
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
    return max(max(sizes), math.ceil(sum(sizes) / target_shards))


def _save(model, tokenizer, directory: Path, max_shard_size: str | int) -> None:
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(directory)
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        raise RuntimeError(
            f"save_pretrained wrote a single file in {directory}; pass a smaller max_shard_size "
            "so the checkpoint is sharded"
        )


def build_model(
    kind: str,
    out_dir: str | Path,
    *,
    size: str = "tiny",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | int | None = None,
) -> Path:
    """Build a random-weight model of ``kind`` ("llama", "gpt2", "mixtral") into ``out_dir`` and return it.

    The folder holds sharded safetensors with ``model.safetensors.index.json``, ``config.json``,
    ``generation_config.json`` and the tokenizer, loadable by plain ``from_pretrained``. The same
    arguments always give the same bytes; a folder already holding that build is returned untouched.
    Sizes: "tiny" for every kind; "100m" and "1b" for "llama" (benchmarks).
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if (kind, size) not in MODEL_SPECS:
        known = ", ".join(f"{k}/{s}" for k, s in MODEL_SPECS)
        raise ValueError(f"no model recipe for kind={kind!r} size={size!r}; known recipes: {known}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    recipe = dict(
        format=BUILD_FORMAT, kind=kind, size=size, dtype=dtype, seed=seed, max_shard_size=max_shard_size,
        tokenizer=tokenizer_fingerprint(), transformers=_transformers_version(),
    )
    if _is_complete(out_dir, recipe):
        return out_dir
    _check_target(out_dir)

    started = time.perf_counter()
    logger.info("building %s/%s (%s, seed %d) into %s", kind, size, dtype, seed, out_dir)
    tokenizer = make_tokenizer()
    config = _make_config(kind, MODEL_SPECS[(kind, size)], tokenizer, dtype)
    with _atomic_build_dir(out_dir) as tmp:
        model = _instantiate(config, dtype, seed)
        _set_generation_ids(model, tokenizer)
        shard = max_shard_size or _default_shard_size(model, TARGET_SHARDS.get(size, 3))
        n_params = sum(p.numel() for p in model.parameters())
        _save(model, tokenizer, tmp, shard)
        del model
        _write_marker(tmp, recipe, parameters=n_params)
    logger.info("built %s/%s: %.1fM parameters in %.1f s", kind, size, n_params / 1e6, time.perf_counter() - started)
    return out_dir


# -------------------------------------------------------------------------------------- demo model


def default_demo_dir() -> Path:
    """Where the demo model lives: ``$LOADMASTER_HOME/demo-model`` (default ``~/.cache/loadmaster``)."""
    home = os.environ.get("LOADMASTER_HOME") or Path.home() / ".cache" / "loadmaster"
    return Path(home).expanduser() / "demo-model"


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
    from tqdm.auto import tqdm

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
        bar = tqdm(range(steps), desc="training demo model", unit="step", leave=False)
        for step in bar:
            batch = sample()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
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
        format=BUILD_FORMAT, kind="demo", spec=DEMO_SPEC, steps=steps, seed=seed, seq_len=DEMO_SEQ_LEN, batch=DEMO_BATCH,
        lr=DEMO_LR, tokenizer=tokenizer_fingerprint(), transformers=_transformers_version(),
    )
    if _is_complete(out_dir, recipe):
        return out_dir
    _check_target(out_dir)

    import torch

    started = time.perf_counter()
    logger.info("building the demo model into %s (about a minute on 2 CPU cores)", out_dir)
    tokenizer = make_tokenizer()
    config = _make_config("llama", DEMO_SPEC, tokenizer, "float32")
    with _atomic_build_dir(out_dir) as tmp:
        torch.manual_seed(seed)
        model = _instantiate(config, "float32", seed)
        _set_generation_ids(model, tokenizer)
        losses = _train_demo(model, tokenizer, steps, seed, max_seconds)
        _save(model, tokenizer, tmp, _default_shard_size(model, 3))
        _write_marker(
            tmp, recipe,
            parameters=sum(p.numel() for p in model.parameters()),
            steps_done=len(losses),
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            seconds=round(time.perf_counter() - started, 1),
        )
    logger.info(
        "demo model ready in %.1f s (loss %.2f -> %.2f)",
        time.perf_counter() - started, losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"),
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
    parser.add_argument("--out", type=Path, default=None, help="model folder (default: %(default)s -> $LOADMASTER_HOME/demo-model)")
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
