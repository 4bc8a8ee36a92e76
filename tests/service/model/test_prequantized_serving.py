"""Every pre-quantized format served by a real uvicorn server, answered to TGI's and OpenAI's own clients.

FP8 (block-wise with half of its layers on disk, which transformers refuses, and compressed-tensors) and
bitsandbytes nf4 run on kernels that keep float32 activations (``linear_fp8``, ``linear_nf4``): their greedy tokens
equal plain transformers' on the dequantized weights. GPTQ, AWQ, compressed-tensors int4, MXFP4 and bitsandbytes
int8 run kernels that round activations to int8 per 64 inputs: their tokens are checked against our own load of the
same checkpoint (the logits' tolerance against the reference is ``tests/loaders/native/test_packed_formats.py``'s)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import text_generation
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.quant_checkpoints import write_quantized
from loaders import load_model
from tests.models import tiny_llama_dir
from tests.service.conftest import LiveServer, settings_for

PROMPT = "The old lighthouse keeper"
NEW = 8
FORMATS = {
    "fp8-disk": (
        "fp8",
        {},
        dict(
            dtype="float32",
            max_memory=["cpu=4GiB", "disk=4GiB"],
            strategy=json.dumps({"model.layers.1": "disk", "model.layers.2": "disk", "": "cpu"}),
        ),
    ),
    "nf4": ("bnb-4bit", dict(quant_type="nf4", double_quant=True), dict(dtype="float32")),
    "gptq4-asym": ("gptq", dict(bits=4, group=64, sym=False, act_order=False), dict(dtype="float32")),
    "awq4": ("awq", dict(group=64), dict(dtype="float32")),
    "ct-int4": ("ct-pack", dict(bits=4, group=64), dict(dtype="float32")),
    "ct-fp8": ("ct-fp8", {}, dict(dtype="float32")),
    "mxfp4": ("mxfp4", {}, dict(dtype="float32")),
    "bnb-int8": ("bnb-int8", {}, dict(dtype="float32")),
}
#: Formats whose kernels keep float32 activations: their greedy tokens are plain transformers' on the dequantized
#: weights. The others (int4, int8, MXFP4 kernels round activations to int8 per 64 inputs) are checked against our
#: own load of the checkpoint.
FLOAT_ACTIVATIONS = ("fp8-disk", "nf4", "ct-fp8")


def _greedy(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def _expected(name: str, d: Path, ref_sd: dict[str, torch.Tensor], ids: torch.Tensor) -> list[int]:
    """Plain transformers on the dequantized weights, or (int4 kernels) our own load of the checkpoint."""
    if name not in FLOAT_ACTIVATIONS:
        return _greedy(load_model(d, device_map="cpu", dtype="float32", show_progress=False), ids)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(), dtype=torch.float32).eval()
    ref.load_state_dict(ref_sd, strict=False)
    return _greedy(ref, ids)


@pytest.mark.parametrize("name", list(FORMATS))
def test_served_prequantized_checkpoint_answers_tgi_and_openai(name: str, tmp_path: Path) -> None:
    fmt, options, serve = FORMATS[name]
    d = tmp_path / name
    ref_sd = write_quantized(tiny_llama_dir(), d, fmt, **options)
    tok = AutoTokenizer.from_pretrained(d)
    want = _expected(name, d, ref_sd, tok(PROMPT, return_tensors="pt")["input_ids"])
    server = LiveServer(settings_for(d, **serve)).start()
    try:
        tgi = text_generation.Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=NEW)
        assert [t.id for t in tgi.details.tokens] == want
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        c = oa.completions.create(model=name, prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert c.choices[0].text == tgi.generated_text and c.usage.completion_tokens == NEW
        if name == "fp8-disk":  # the plan in force put two layers on disk and named their kernel
            plan = httpx.get(server.url + "/info", timeout=30).json()["plan"]
            assert plan["placement"]["model.layers.1"] == "disk" and plan["kernels"]["disk"].startswith("linear_fp8")
    finally:
        server.stop()


def test_served_gpt_oss_mxfp4_experts_with_layers_on_disk_answer_tgi_and_openai(tmp_path: Path) -> None:
    """gpt-oss's own MXFP4 layout (its routed experts packed, the rest float), half its layers on disk: the clients'
    greedy tokens are our own load's of the same checkpoint, and the plan names the MXFP4 kernel for the disk."""
    from tests.models import tiny_gpt_oss_dir

    d = tmp_path / "gpt-oss-mxfp4"
    write_quantized(tiny_gpt_oss_dir(), d, "mxfp4")
    tok = AutoTokenizer.from_pretrained(d)
    want = _greedy(
        load_model(d, device_map="cpu", dtype="float32", show_progress=False),
        tok(PROMPT, return_tensors="pt")["input_ids"],
    )
    placement = {"model.layers.1": "disk", "model.layers.2": "disk", "": "cpu"}
    serve = dict(dtype="float32", max_memory=["cpu=4GiB", "disk=4GiB"], strategy=json.dumps(placement))
    server = LiveServer(settings_for(d, **serve)).start()
    try:
        tgi = text_generation.Client(server.url, timeout=60).generate(PROMPT, max_new_tokens=NEW)
        assert [t.id for t in tgi.details.tokens] == want
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        c = oa.completions.create(model="gpt-oss-mxfp4", prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert c.choices[0].text == tgi.generated_text and c.usage.completion_tokens == NEW
        plan = httpx.get(server.url + "/info", timeout=30).json()["plan"]
        assert plan["placement"]["model.layers.1"] == "disk" and plan["kernels"]["disk"].startswith("linear_mxfp4")
    finally:
        server.stop()
