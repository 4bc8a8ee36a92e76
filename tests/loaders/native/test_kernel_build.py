"""The native CPU kernels (bf16, fp32), on every instruction-set path this CPU has: results against the exact
product, operator registration, the build cache, and models that use them still match transformers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loaders
from loaders.native import kernel_build, operators
from loaders.native.linear import NativeCPULinear, SharedInputGroup, use_native_linears
from tests.loaders.helpers import prompt, reference_model

ROOT = Path(__file__).resolve().parents[3]
HAS_NATIVE = bool(kernel_build.runnable_isas())
needs_kernel = pytest.mark.skipif(not HAS_NATIVE, reason="this CPU has neither AVX-512 nor AVX2: no native path")


def test_status_says_why():
    kernel_build.reset()
    st = kernel_build.status()
    if HAS_NATIVE and kernel_build._compiler():
        assert st.available, st.reason
        assert st.isa == kernel_build.runnable_isas()[0]  # the best path the CPU runs
        assert Path(st.library).is_file()
    else:
        assert not st.available and st.reason
    with pytest.raises(ValueError, match="no native kernel"):
        kernel_build.status(torch.float16)


def test_isa_setting_is_validated_and_forced_paths_need_the_cpu(monkeypatch):
    monkeypatch.setenv("LOADMASTER_CPU_ISA", "sse9")
    kernel_build.reset()
    st = kernel_build.status()
    assert not st.available and "LOADMASTER_CPU_ISA='sse9'" in st.reason and "avx2" in st.reason
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse2"})
    monkeypatch.setenv("LOADMASTER_CPU_ISA", "avx512")
    kernel_build.reset()
    st = kernel_build.status()
    assert not st.available and "lacks avx512f" in st.reason and "runnable here: avx2" in st.reason
    monkeypatch.setenv("LOADMASTER_CPU_ISA", "auto")
    assert kernel_build.select_isa()[0] == "avx2"  # an AVX2-only CPU gets the AVX2 path
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"sse2", "asimd"})
    assert kernel_build.select_isa()[0] is None  # elsewhere (e.g. aarch64): torch's kernels
    monkeypatch.undo()
    kernel_build.reset()


def _ulp_bound(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step of the exact result, plus slack for float32 summation order."""
    return ref.abs() * 2.0**-7 + 1e-3


@pytest.mark.parametrize("m", [1, 3, 4, 7, 32])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 100), (5, 15), (130, 4096 + 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_exact_product(kernel_path, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    assert operators.supports(x, w) == kernel_path.available
    out = operators.linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    # float32 summation error bound: a few ulps of the sum of |terms|
    bound = (x.double().abs() @ w.double().abs().T) * 4 * k * 2.0**-24 + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()
    # torch's own product carries the same kind of rounding (MKL's order differs by CPU): agree within both bounds
    reference = torch.nn.functional.linear(x, w, b).double()
    assert ((out.double() - reference).abs() <= 2 * bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_their_batch(native_path, dtype):
    """A row's result is summed in the same order whatever the number of rows: batching cannot change it."""
    rows = kernel_build.KERNELS[dtype].max_rows
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(rows, 300, generator=g).to(dtype), torch.randn(70, 300, generator=g).to(dtype)
    together = operators.linear(x, w, None)
    for i in (0, 5, rows - 1):
        assert torch.equal(operators.linear(x[i : i + 1], w, None), together[i : i + 1])
    assert torch.equal(operators.linear(x[3:7], w, None), together[3:7])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 100), (5, 31), (130, 4096 + 7), (256, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_product(kernel_path, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    out = operators.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert ((out.double() - exact).abs() <= _ulp_bound(exact)).all()
    torch_out = torch.nn.functional.linear(x, w, b)
    # Same rounding as torch except where float32 summation order lands on the other side of a bf16 step.
    assert ((out.double() - torch_out.double()).abs() <= _ulp_bound(exact) * 2).all()
    assert (out == torch_out).float().mean() > 0.9


def test_strided_operands_and_batch_shapes(kernel_path):
    w_full = torch.randn(48, 160).to(torch.bfloat16)
    w = w_full[:, :128]  # rows with a stride longer than their length: a view into a bigger map
    x = torch.randn(2, 1, 128).to(torch.bfloat16)
    assert operators.supports(x, w) == kernel_path.available
    out = operators.linear(x, w, None)
    assert out.shape == (2, 1, 48)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(out.float(), ref, rtol=2**-7, atol=1e-2)
    xt = torch.randn(128, 3).to(torch.bfloat16).T  # non-contiguous activations are copied, not misread
    assert torch.allclose(
        operators.linear(xt, w, None).float(), torch.nn.functional.linear(xt.float(), w.float()), rtol=2**-7, atol=1e-2
    )


def test_supports_only_small_cpu_products_in_a_loaded_dtype(native_path):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    max_rows = kernel_build.KERNELS[torch.bfloat16].max_rows
    assert operators.supports(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    assert not operators.supports(torch.zeros(max_rows + 1, 16, dtype=torch.bfloat16), w)
    assert not operators.supports(torch.zeros(1, 16), w)  # mixed dtypes
    assert not operators.supports(torch.zeros(1, 16, dtype=torch.float16), w.half())  # no fp16 kernel
    assert not operators.supports(torch.zeros(1, 16, dtype=torch.bfloat16), w.T.contiguous().T)
    x = torch.zeros(1, 16, dtype=torch.bfloat16, requires_grad=True)
    assert not operators.supports(x, w)
    with torch.no_grad():
        assert operators.supports(x, w)


#: torch's own checks of a custom operator that apply to ours (schema, fake tensors through its Meta kernel).
_OPCHECKS = ("test_schema", "test_faketensor")


def test_operator_checks_operands_and_has_fake_shapes(kernel_path):
    """Registered with torch.library: wrong operands raise a clear error; fake tensors give shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.randn(12, 40).to(torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit weight"):
        torch.ops.loadmaster.linear(torch.randn(2, 41).to(torch.bfloat16), w, None)
    with pytest.raises(ValueError, match="bfloat16 or float32 weights"):
        torch.ops.loadmaster.linear(torch.randn(2, 40).half(), w.half(), None)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(3, 5, 40).to(torch.bfloat16))
        out = torch.ops.loadmaster.linear(fx, mode.from_tensor(w), None)
    assert tuple(out.shape) == (3, 5, 12) and out.dtype == torch.bfloat16
    meta = torch.ops.loadmaster.linear(torch.empty(4, 40, device="meta"), torch.empty(7, 40, device="meta"), None)
    assert meta.shape == (4, 7) and meta.device.type == "meta"
    checks = torch.library.opcheck(
        torch.ops.loadmaster.linear.default, (torch.randn(3, 40).bfloat16(), w, None), test_utils=_OPCHECKS
    )
    assert set(checks.values()) == {"SUCCESS"}, checks
    # Beyond the kernel's rows the operator runs torch's GEMM: the same result as F.linear, exactly.
    x = torch.randn(100, 40).to(torch.bfloat16)
    assert torch.equal(torch.ops.loadmaster.linear(x, w, None), torch.nn.functional.linear(x, w))


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
    model = loaders.load_model(
        tiny_llama, device_map=dm, dtype="bfloat16", offload_folder=tmp_path / "off", show_progress=False
    )
    assert model.load_stats.native_linears > 0
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is NativeCPULinear for m in linears)
    plain = loaders.load_model(
        tiny_llama,
        device_map=dm,
        dtype="bfloat16",
        offload_folder=tmp_path / "off",
        show_progress=False,
        cpu_kernels="torch",
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_products_sharing_an_input_equal_their_separate_calls(kernel_path, dtype, m):
    """``linear_multi`` (one native call for q, k and v, say) gives each product bit for bit what its own call
    gives, biases and odd widths included."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1, 200, generator=g).to(dtype)
    weights = [torch.randn(n, 200, generator=g).to(dtype) for n in (64, 13, 36)]
    biases = [None, torch.randn(13, generator=g).to(dtype), None]
    together = operators.linear_multi(x, weights, biases)
    assert [tuple(o.shape) for o in together] == [(m, 1, 64), (m, 1, 13), (m, 1, 36)]
    for out, w, b in zip(together, weights, biases):
        assert torch.equal(out, operators.linear(x, w, b))
        assert torch.allclose(out.float(), torch.nn.functional.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        operators.linear_multi(x, weights[:2], biases[:1])


def _grouped_model(tiny_llama, dtype: str):
    return loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype=dtype, show_progress=False)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sibling_projections_share_one_call_and_change_nothing(tiny_llama, dtype):
    """q/k/v and gate/up of every layer form groups; logits and greedy tokens are exactly those of the same model
    with every projection called on its own."""
    model = _grouped_model(tiny_llama, dtype)
    layers = model.config.num_hidden_layers
    groups = {id(m.shared_input_group) for m in model.modules() if getattr(m, "shared_input_group", None)}
    assert len(groups) == 2 * layers
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.shared_input_group is attention.v_proj.shared_input_group is not None
    ids = prompt(model.config.vocab_size, batch=3)
    with torch.inference_mode():
        grouped = model(ids).logits
        step = model(ids[:, :1]).logits  # one row per sequence: the decode shape, where the kernels run
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for m in model.modules():
            if isinstance(m, NativeCPULinear):
                m.shared_input_group = None
        assert torch.equal(model(ids).logits, grouped)
        assert torch.equal(model(ids[:, :1]).logits, step)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), tokens)


@needs_kernel
def test_a_sibling_called_on_another_input_computes_its_own(tiny_llama):
    """What the first call kept is only handed to a sibling called with that very tensor."""
    model = _grouped_model(tiny_llama, "float32")
    attention = model.model.layers[0].self_attn
    group = attention.q_proj.shared_input_group
    assert isinstance(group, SharedInputGroup)
    width = attention.q_proj.in_features
    a, b = torch.randn(2, 1, width), torch.randn(2, 1, width)
    with torch.inference_mode():
        q = attention.q_proj(a)
        k_other = attention.k_proj(b)  # not a: computed for b, and a's kept results are dropped
        assert torch.equal(q, operators.linear(a, attention.q_proj.weight, attention.q_proj.bias))
        assert torch.equal(k_other, operators.linear(b, attention.k_proj.weight, attention.k_proj.bias))
        assert torch.equal(attention.v_proj(a), operators.linear(a, attention.v_proj.weight, attention.v_proj.bias))
        # the regular order: q computes all three, k and v take theirs
        q = attention.q_proj(b)
        assert group._kept.value[0] is b  # k's and v's products were computed with q's, and wait for them
        k, v = attention.k_proj(b), attention.v_proj(b)
        for out, proj in ((q, attention.q_proj), (k, attention.k_proj), (v, attention.v_proj)):
            assert torch.equal(out, operators.linear(b, proj.weight, proj.bias))
        assert getattr(group._kept, "value", None) is None  # nothing held once every member took its result


def test_torch_choice_and_unknown_choice(tiny_llama, tmp_path):
    model = loaders.load_model(
        tiny_llama, device_map={"": "cpu"}, dtype="bfloat16", show_progress=False, cpu_kernels="torch"
    )
    assert model.load_stats.native_linears == 0
    with pytest.raises(ValueError, match="cpu_kernels"):
        use_native_linears(model, "fastest")


@needs_kernel
def test_fp32_model_on_the_kernel_matches_transformers(tiny_llama, tmp_path):
    """fp32 decode on the kernel: logits within 1e-5 of transformers' and identical greedy tokens."""
    from tests.loaders.helpers import assert_equivalent

    dm = {"model.layers.1": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(tiny_llama, device_map=dm, offload_folder=tmp_path / "off", show_progress=False)
    assert model.load_stats.native_linears == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    assert model.load_stats.zero_copy_bytes > 0 and model.load_stats.offload_bytes_written == 0
    assert_equivalent(model, tiny_llama, new_tokens=12)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def test_disabled_by_environment_and_native_then_refuses(tmp_path):
    code = (
        "import torch; from torch import nn; from loaders.native import kernel_build; "
        "from loaders.native.linear import use_native_linears\n"
        "st = kernel_build.status(); assert not st.available and 'LOADMASTER_CPU_KERNELS' in st.reason\n"
        "m = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)\n"
        "assert use_native_linears(m, 'auto') == 0\n"
        "try:\n    use_native_linears(m, 'native')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    for env in ({"LOADMASTER_CPU_KERNELS": "torch"}, {"LOADMASTER_CPU_ISA": "torch"}):
        r = _run(code, {**env, "LOADMASTER_KERNEL_CACHE": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        assert "refused:" in r.stdout and "LOADMASTER_CPU_ISA=torch" in r.stdout


_STATUS = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from loaders.native import kernel_build; st = kernel_build.status(); print(st.available, '|', st.library, '|', "
    "st.reason)"
)


@needs_kernel
def test_concurrent_first_builds_leave_one_complete_library(tmp_path):
    """Several processes building into an empty cache at once all load a complete library; no temp files stay."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STATUS],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    libs = {o[0].split("|")[1].strip() for o in outs}
    assert len(libs) == 1 and all(o[0].startswith("True") for o in outs)
    lib = Path(libs.pop())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([lib.name, lib.with_suffix(".json").name])


@needs_kernel
def test_built_once_then_reused_and_a_stale_manifest_is_rebuilt(tmp_path):
    """The first use builds (one log line); the next process builds nothing; a manifest that does not match the
    sources, flags or path is not trusted, and the library is rebuilt."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path)}
    first = _run(_STATUS, env)
    assert first.returncode == 0 and first.stdout.startswith("True"), first.stderr
    assert first.stderr.count("building the native CPU kernels") == 1
    lib = Path(first.stdout.split("|")[1].strip())
    manifest = json.loads(lib.with_suffix(".json").read_text())
    assert manifest["isa"] == kernel_build.runnable_isas()[0] and manifest["source_hash"] == kernel_build.source_hash()
    assert manifest["compiler"] and manifest["cflags"][-1].startswith("-m")
    mtime = lib.stat().st_mtime_ns
    second = _run(_STATUS, env)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "building" not in second.stderr and lib.stat().st_mtime_ns == mtime
    lib.with_suffix(".json").write_text(json.dumps({**manifest, "source_hash": "0" * 64}))
    third = _run(_STATUS, env)
    assert third.returncode == 0 and third.stdout.startswith("True") and "building" in third.stderr
    assert json.loads(lib.with_suffix(".json").read_text()) == manifest


@needs_kernel
def test_a_library_built_ahead_is_used_where_no_compiler_is(tmp_path):
    """An image builds the kernels in its build stage; the runtime has no compiler and still uses them. Without
    any library, one log line says why and torch's kernels run."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path / "cache"), "PATH": str(tmp_path / "empty-bin"), "CC": ""}
    r = _run(_STATUS, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False |") and "no C compiler" in r.stdout
    assert [line for line in r.stderr.splitlines() if "kernel_build" in line and "no C compiler" in line]
    built = _run(
        "from loaders.native import kernel_build; print(*kernel_build.build_all(), sep='\\n')",
        {"LOADMASTER_KERNEL_CACHE": str(tmp_path / "cache")},
    )
    assert built.returncode == 0, built.stderr
    libs = built.stdout.split()
    assert len(libs) == len(kernel_build.ISAS)
    assert all(Path(p).stat().st_mode & 0o777 == 0o755 for p in libs)  # loadable by other users (an image's)
    r = _run(_STATUS, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True |"), r.stdout


@needs_kernel
def test_a_library_for_another_path_is_refused(tmp_path, monkeypatch):
    """The loaded library must report the path it was asked for: a mislabelled cache entry is not run."""
    monkeypatch.setenv("LOADMASTER_KERNEL_CACHE", str(tmp_path))
    isas = list(kernel_build.ISAS)
    wrong = kernel_build.build(isas[1])
    with pytest.raises(OSError, match=f"holds the {isas[1]} path, not {isas[0]}"):
        kernel_build._Library(wrong, isas[0])


@needs_kernel
def test_a_path_that_fails_to_build_gives_way_to_the_next(tmp_path, monkeypatch):
    """A compiler too old for the best path (AMX, say) must not cost the CPU its native kernels: picked from the
    flags, the next runnable path is built and used, and ``build_all`` leaves the failing path out; forced, the
    failure is reported as it is."""
    monkeypatch.setenv("LOADMASTER_KERNEL_CACHE", str(tmp_path))
    runnable = kernel_build.runnable_isas()
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs one native path ({runnable}); there is no next one to give way to")
    best, second = runnable[0], runnable[1]
    real_flags = kernel_build._flags
    monkeypatch.setattr(
        kernel_build, "_flags", lambda isa: [*real_flags(isa), "-mno-such-flag"] if isa == best else real_flags(isa)
    )
    monkeypatch.setenv("LOADMASTER_CPU_ISA", "auto")
    kernel_build.reset()
    st = kernel_build.status()
    assert st.available and st.isa == second, st
    assert f"the {best} path failed to build" in st.reason
    built = kernel_build.build_all()
    assert len(built) == len(kernel_build.ISAS) - 1
    monkeypatch.setenv("LOADMASTER_CPU_ISA", best)
    kernel_build.reset()
    st = kernel_build.status()
    assert not st.available and "building the kernels failed" in st.reason and st.isa == best
    monkeypatch.undo()
    kernel_build.reset()


_USE_KERNELS = (
    "import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from torch import nn; from loaders.native import kernel_build; from loaders.native.linear import use_native_linears\n"
    "st = kernel_build.status(); print(st.available, '|', st.library, flush=True)\n"
    "m = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)\n"
    "assert use_native_linears(m, 'auto') == 1\n"
    "x = torch.randn(1, 64, dtype=torch.bfloat16)\n"
    "import os, time\n"
    "if len(sys.argv) > 1:  # truncate the cached library under this running process, then use the kernels\n"
    "    os.truncate(st.library, 0)\n"
    "for _ in range(3): y = m(x)\n"
    "print('ran', float(y.float().abs().sum()) >= 0)\n"
)


@needs_kernel
def test_the_manifest_records_size_and_hash_and_a_damaged_library_is_rebuilt(tmp_path):
    """A cached library truncated, or rewritten with other bytes of the same size, with its manifest intact, is
    rebuilt at the next start (the manifest's size and SHA-256 no longer match), never loaded."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path)}
    first = _run(_STATUS, env)
    assert first.returncode == 0 and first.stdout.startswith("True"), first.stderr
    lib = Path(first.stdout.split("|")[1].strip())
    manifest = json.loads(lib.with_suffix(".json").read_text())
    image = lib.read_bytes()
    assert manifest["size"] == len(image) and manifest["sha256"] == hashlib.sha256(image).hexdigest()
    for damage in (lambda: os.truncate(lib, len(image) // 3), lambda: lib.write_bytes(image[:-64] + b"\0" * 64)):
        damage()
        r = _run(_USE_KERNELS, env)
        assert r.returncode == 0, r.stderr  # never a SIGBUS (-7)
        assert "does not match its manifest" in r.stderr and "building the native CPU kernels" in r.stderr
        assert r.stdout.startswith("True") and "ran True" in r.stdout
        assert lib.read_bytes() == image


@needs_kernel
def test_a_library_truncated_under_a_running_process_does_not_kill_it(tmp_path):
    """The library is loaded from a private in-memory copy, so truncating the cache file while the process runs
    its kernels cannot raise SIGBUS."""
    env = {"LOADMASTER_KERNEL_CACHE": str(tmp_path)}
    assert _run(_STATUS, env).returncode == 0
    r = subprocess.run(
        [sys.executable, "-c", _USE_KERNELS, "truncate"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "ran True" in r.stdout
