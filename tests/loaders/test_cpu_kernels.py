"""The native CPU kernels (bf16, fp32): results against the exact product, and models that use them still match."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loaders
from loaders import cpu_kernels
from loaders.fast_linear import NativeCPULinear, use_native_linears
from tests.loaders.helpers import prompt, reference_model

ROOT = Path(__file__).resolve().parents[2]
BF16 = cpu_kernels.KERNELS[torch.bfloat16]
HAS_CPU = all(f in cpu_kernels.cpu_flags() for f in BF16.cpu_flags)
HAS_AVX512F = "avx512f" in cpu_kernels.cpu_flags()
needs_kernel = pytest.mark.skipif(not HAS_CPU, reason="this CPU lacks avx512_bf16: the native kernel cannot run")
needs_f32_kernel = pytest.mark.skipif(not HAS_AVX512F, reason="this CPU lacks avx512f: the fp32 kernel cannot run")


@pytest.mark.parametrize("dtype,capable", [(torch.bfloat16, HAS_CPU), (torch.float32, HAS_AVX512F)])
def test_status_says_why(dtype, capable):
    st = cpu_kernels.status(dtype)
    if capable and cpu_kernels._compiler():
        # On a capable machine with a compiler the kernel must build: a broken build is a failure, not a fallback.
        assert st.available, st.reason
        assert Path(st.library).is_file()
    else:
        assert not st.available and st.reason


def _ulp_bound(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step of the exact result, plus slack for float32 summation order."""
    return ref.abs() * 2.0 ** -7 + 1e-3


@needs_f32_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 7, 32])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 100), (5, 15), (130, 4096 + 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_exact_product(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    assert cpu_kernels.supports(x, w)
    out = cpu_kernels.linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    # float32 summation error bound: a few ulps of the sum of |terms|
    bound = (x.double().abs() @ w.double().abs().T) * 4 * k * 2.0 ** -24 + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()
    assert torch.allclose(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,capable", [(torch.float32, HAS_AVX512F), (torch.bfloat16, HAS_CPU)])
def test_rows_do_not_depend_on_their_batch(dtype, capable):
    """A row's result is summed in the same order whatever the number of rows: batching cannot change it."""
    if not capable:
        pytest.skip(f"this CPU cannot run the {dtype} kernel")
    assert cpu_kernels.status(dtype).available
    rows = cpu_kernels.KERNELS[dtype].max_rows
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(rows, 300, generator=g).to(dtype), torch.randn(70, 300, generator=g).to(dtype)
    together = cpu_kernels.linear(x, w)
    for i in (0, 5, rows - 1):
        assert torch.equal(cpu_kernels.linear(x[i:i + 1], w), together[i:i + 1])
    assert torch.equal(cpu_kernels.linear(x[3:7], w), together[3:7])


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 100), (5, 31), (130, 4096 + 7), (256, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_product(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    out = cpu_kernels.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert ((out.double() - exact).abs() <= _ulp_bound(exact)).all()
    torch_out = torch.nn.functional.linear(x, w, b)
    # Same rounding as torch except where float32 summation order lands on the other side of a bf16 step.
    assert ((out.double() - torch_out.double()).abs() <= _ulp_bound(exact) * 2).all()
    assert (out == torch_out).float().mean() > 0.9


@needs_kernel
def test_strided_operands_and_batch_shapes():
    w_full = torch.randn(48, 160).to(torch.bfloat16)
    w = w_full[:, :128]  # rows with a stride longer than their length: a view into a bigger map
    x = torch.randn(2, 1, 128).to(torch.bfloat16)
    assert cpu_kernels.supports(x, w)
    out = cpu_kernels.linear(x, w)
    assert out.shape == (2, 1, 48)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-2)
    xt = torch.randn(128, 3).to(torch.bfloat16).T  # non-contiguous activations are copied, not misread
    assert torch.allclose(cpu_kernels.linear(xt, w).float(), torch.nn.functional.linear(xt.float(), w.float()),
                          rtol=2 ** -7, atol=1e-2)


@needs_kernel
def test_supports_only_small_cpu_products_in_a_loaded_dtype():
    cpu_kernels.status(torch.bfloat16)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert cpu_kernels.supports(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    assert not cpu_kernels.supports(torch.zeros(BF16.max_rows + 1, 16, dtype=torch.bfloat16), w)
    assert not cpu_kernels.supports(torch.zeros(1, 16), w)  # mixed dtypes
    assert not cpu_kernels.supports(torch.zeros(1, 16, dtype=torch.float16), w.half())  # no fp16 kernel
    assert not cpu_kernels.supports(torch.zeros(1, 16, dtype=torch.bfloat16), w.T.contiguous().T)
    x = torch.zeros(1, 16, dtype=torch.bfloat16, requires_grad=True)
    assert not cpu_kernels.supports(x, w)
    with torch.no_grad():
        assert cpu_kernels.supports(x, w)


@pytest.fixture(scope="module")
def tiny_llama_bf16(tiny_llama, tmp_path_factory):
    """The tiny Llama stored in bf16, so that bf16 disk layers are zero-copy views of its shards."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama-bf16")
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(out, max_shard_size="300KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


@needs_kernel
def test_model_on_the_kernel_matches_transformers(tiny_llama_bf16, tmp_path):
    """bf16 Llama with half its layers on disk: same parameters, same tensors, logits within bf16 rounding."""
    tiny_llama = tiny_llama_bf16
    dm = {"model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(tiny_llama, device_map=dm, dtype="bfloat16", offload_folder=tmp_path / "off",
                               show_progress=False)
    assert model.load_stats.native_linears > 0
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is NativeCPULinear for m in linears)
    plain = loaders.load_model(tiny_llama, device_map=dm, dtype="bfloat16", offload_folder=tmp_path / "off",
                               show_progress=False, cpu_kernels="torch")
    assert not any(type(m) is NativeCPULinear for m in plain.modules())
    # Nothing was copied or moved: the disk layers' weights are still views of the shard maps.
    assert model.load_stats.zero_copy_bytes == plain.load_stats.zero_copy_bytes > 0
    assert model.load_stats.offload_bytes_written == 0
    assert list(model.state_dict()) == list(plain.state_dict())
    ref = reference_model(str(tiny_llama), "bfloat16")
    ids = prompt(ref.config.vocab_size, batch=1)
    with torch.no_grad():
        ours = torch.stack([model(ids[:, : i + 1]).logits[0, -1] for i in range(ids.shape[1])]).float()
        theirs = torch.stack([ref(ids[:, : i + 1]).logits[0, -1] for i in range(ids.shape[1])]).float()
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 0.02 * scale
    g_ours = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    g_ref = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(g_ours, g_ref)


def test_torch_choice_and_unknown_choice(tiny_llama, tmp_path):
    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype="bfloat16", show_progress=False,
                               cpu_kernels="torch")
    assert model.load_stats.native_linears == 0
    with pytest.raises(ValueError, match="cpu_kernels"):
        use_native_linears(model, "fastest")


@needs_f32_kernel
def test_fp32_model_on_the_kernel_matches_transformers(tiny_llama, tmp_path):
    """fp32 decode on the kernel: logits within 1e-5 of transformers' and identical greedy tokens."""
    from tests.loaders.helpers import assert_equivalent

    dm = {"model.layers.1": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(tiny_llama, device_map=dm, offload_folder=tmp_path / "off", show_progress=False)
    assert model.load_stats.native_linears == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    assert model.load_stats.zero_copy_bytes > 0 and model.load_stats.offload_bytes_written == 0
    assert_equivalent(model, tiny_llama, new_tokens=12)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_disabled_by_environment_and_native_then_refuses(tmp_path):
    code = ("import torch; from torch import nn; from loaders import cpu_kernels; "
            "from loaders.fast_linear import use_native_linears\n"
            "st = cpu_kernels.status(); assert not st.available and 'LOADMASTER_CPU_KERNELS' in st.reason\n"
            "m = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)\n"
            "assert use_native_linears(m, 'auto') == 0\n"
            "try:\n    use_native_linears(m, 'native')\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    r = _run(code, {"LOADMASTER_CPU_KERNELS": "torch", "LOADMASTER_KERNEL_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "LOADMASTER_CPU_KERNELS=torch" in r.stdout


@needs_kernel
def test_concurrent_first_builds_leave_one_complete_library(tmp_path):
    """Several processes building into an empty cache at once all load a complete library; no temp files stay."""
    code = "from loaders import cpu_kernels; st = cpu_kernels.status(); assert st.available, st.reason; print(st.library)"
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    libs = {o[0].strip() for o in outs}
    assert len(libs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(libs.pop()).name]


@needs_kernel
def test_a_library_built_ahead_is_used_where_no_compiler_is(tmp_path):
    """An image builds the kernel in its build stage; the runtime has no compiler and still uses it."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path / "cache"), "PATH": str(tmp_path / "empty-bin"), "CC": ""}
    code = "from loaders import cpu_kernels; st = cpu_kernels.status(); print(st.available, '|', st.reason)"
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False |") and "no C compiler" in r.stdout
    built = _run("from loaders import cpu_kernels; print(*cpu_kernels.build_all(), sep='\\n')",
                 {"LOADMASTER_KERNEL_CACHE": str(tmp_path / "cache")})
    assert built.returncode == 0, built.stderr
    libs = built.stdout.split()
    assert len(libs) == len(cpu_kernels.KERNELS)
    assert all(Path(p).stat().st_mode & 0o777 == 0o755 for p in libs)  # loadable by other users (an image's)
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True |"), r.stdout
