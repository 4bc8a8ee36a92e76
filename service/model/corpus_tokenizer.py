"""The tokenizer every built model shares: a byte-level BPE trained offline on the bundled public-domain text.

No model hub is reachable where loadmaster is built and tested, so the demo model, the test models and the benchmark
models all get their tokenizer from here: trained in well under a second on ``service/model/data/*.txt``, deterministic
(the same text gives the same vocabulary), with ``<s>``, ``</s>``, ``<pad>``, ``<unk>`` and a plain chat template.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

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
