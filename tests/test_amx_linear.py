"""bf16 linear layers on packed weights (AMX tiles, or AVX-512 FMAs without them) against
F.linear in float32, and their backends in the engine. Where the CPU lacks what a kernel needs,
the kernel must say so (and the engine keep oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import amx, pointwise
from kvserve.model.linear_ops import (
    KERNEL_WEIGHTS,
    AMXOps,
    OneDNNOps,
    PackedOps,
    TorchOps,
    linear_layers,
    select_ops,
)
from kvserve.model.llama import RMSNorm

AMX = torch.cpu._is_amx_tile_supported()


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(ln.split(":")[1].split()) for ln in f if ln.startswith("flags")), set())


AVX512 = "avx512f" in _cpu_flags()


def test_kernels_are_available_exactly_where_the_cpu_has_their_instructions(monkeypatch):
    """AMX first where the CPU has it; otherwise the AVX-512 kernel for bf16 (alone, or beside
    float32 copies for large steps); float32 models on the AVX-512 kernel's float32 tiles
    where the CPU has AVX-512, else oneDNN."""
    assert amx.available() == AMX
    assert amx.avx512_available() == AVX512
    ops = select_ops(torch.device("cpu"), torch.bfloat16)
    assert isinstance(ops, AMXOps) == AMX
    if not AMX:
        assert isinstance(ops, PackedOps) and ops.kernel == ("avx512" if AVX512 else None)
    f32 = select_ops(torch.device("cpu"), torch.float32)
    assert isinstance(f32, PackedOps) == AVX512
    assert f32.name == ("avx512-f32" if AVX512 else "onednn")
    monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    monkeypatch.setenv("KVSERVE_DISABLE_AVX512_GEMM", "1")  # the A/B switches: oneDNN's
    for dtype in (torch.bfloat16, torch.float32):
        ops = select_ops(torch.device("cpu"), dtype)
        assert not isinstance(ops, PackedOps) or ops.kernel is None


needs_amx = pytest.mark.skipif(not AMX, reason="no AMX on this CPU: oneDNN serves (tested above)")
needs_avx512 = pytest.mark.skipif(not AVX512, reason="no AVX-512 on this CPU (tested above)")
AVX512_BF16 = AVX512 and "avx512_bf16" in _cpu_flags()
needs_avx512_bf16 = pytest.mark.skipif(
    not AVX512_BF16, reason="no AVX512-BF16 on this CPU: the FMA tiles serve (tested above)"
)
# "avx512" in its float32-FMA mode, "avx512-dot" in its bf16 dot-product mode
KERNELS = [
    pytest.param("amx", marks=needs_amx),
    pytest.param("avx512", marks=needs_avx512),
    pytest.param("avx512-dot", marks=needs_avx512_bf16),
]


@pytest.fixture
def kernel_mode(request):
    """Maps a KERNELS name to amx.linear's kernel, with the AVX-512 kernel's mode set for the
    test and the process's measured mode put back after it."""
    lib = amx._LIB512.get()
    chosen = amx.avx512_dot_products() if lib is not None else False

    def mode(name: str) -> str:
        if name.startswith("avx512"):
            assert lib.kvserve_avx512_set_dot(name == "avx512-dot") == (name == "avx512-dot")
            return "avx512"
        return name

    yield mode
    if lib is not None:
        lib.kvserve_avx512_set_dot(chosen)


def test_avx512_dot_mode_is_chosen_by_measurement_or_the_environment(monkeypatch):
    """KVSERVE_AVX512_BF16_DOT: 1 / 0 decides (1 only where the build has the dot products),
    anything else is refused naming it; without it the probe decides, once."""
    lib = amx._LIB512.get()
    chosen = amx.avx512_dot_products()
    try:
        for value, want in (("0", False), ("1", AVX512_BF16)):
            monkeypatch.setenv("KVSERVE_AVX512_BF16_DOT", value)
            assert amx.avx512_dot_products() is want
            if lib is not None:  # the kernel's mode follows
                assert lib.kvserve_avx512_set_dot(want) == want
        monkeypatch.setenv("KVSERVE_AVX512_BF16_DOT", "yes")
        with pytest.raises(ValueError, match="KVSERVE_AVX512_BF16_DOT"):
            amx.avx512_dot_products()
    finally:
        if lib is not None:
            lib.kvserve_avx512_set_dot(chosen)
    assert not chosen or AVX512_BF16


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 7, 12, 13, 31, 32, 33, 64, 100, 160, 300])
@pytest.mark.parametrize(
    "k, n", [(64, 32), (576, 960), (512, 1536), (1536, 576), (1216, 96), (576, 2496)]
)
def test_packed_linear_matches_float32_reference(kernel_mode, kernel, m, k, n):
    """Plain, with a bias, with a residual and SwiGLU's gate/up pair: each within one bf16
    rounding of the float32 result of the same bf16 inputs, any row count (tails padded; the
    AVX-512 kernel's register tiles of 1-4 and 5-12 rows, its blocks of 96 rows; the AMX
    kernel's K in chunks for prefill-sized steps, even and uneven, its column groups that fit
    L2, even (512 x 1536 SwiGLU) and uneven (576 x 2496 SwiGLU), and its prefill-sized reads
    of x in place, whole row blocks (160) and with a partial last one (300)), in both of the
    AVX-512 kernel's modes."""
    kernel = kernel_mode(kernel)
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    wu = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    res = torch.randn(m, n, generator=g).to(torch.bfloat16)
    wp, wup = amx.pack(w), amx.pack(wu)
    ref = x.float() @ w.float().t()
    cases = [
        (amx.linear(x, wp, kernel=kernel), ref),
        (amx.linear(x, wp, bias=bias, kernel=kernel), ref + bias.float()),
        (amx.linear(x, wp, residual=res, kernel=kernel), ref + res.float()),
        (amx.linear(x, wp, up=wup, kernel=kernel), F.silu(ref) * (x.float() @ wu.float().t())),
    ]
    for got, want in cases:
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("k, n", [(576, 960), (1216, 96)])
def test_fused_rms_norm_is_the_norm_then_the_linear(kernel_mode, kernel, m, k, n):
    """With ``norm`` the kernel normalises each row as it copies it in: bit for bit the native
    RMSNorm followed by the plain kernel (a decode-sized, a prefill-sized and, at K 1,216, a
    K-chunked step; strided rows), plain and SwiGLU; and within bf16 rounding of
    RMSNorm.forward followed by the float32 product."""
    kernel = kernel_mode(kernel)
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k + 32, generator=g) * 3).to(torch.bfloat16)[:, 16 : 16 + k]
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    wu = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    wp, wup = amx.pack(w), amx.pack(wu)
    normed = pointwise.rms_norm(x, nw, 1e-5)
    for up in (None, wup):
        fused = amx.linear(x, wp, up=up, kernel=kernel, norm=(nw, 1e-5))
        assert torch.equal(fused, amx.linear(normed, wp, up=up, kernel=kernel))
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = nw
    xn = norm(x).float()
    want = xn @ w.float().t()
    got = amx.linear(x, wp, kernel=kernel, norm=(nw, 1e-5))
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [5, 200])
def test_outputs_round_to_bf16_as_torch_does(kernel_mode, kernel, m):
    """The epilogue's rounding to bf16 against torch's, bit for bit: ties to even (sums
    1 + c 2^-8 exact in float32, half an ulp of bf16 for odd c), and through the bias and the
    residual the values a fast conversion instruction would get wrong or lose: float32
    denormals (flushed to zero by AVX512-BF16's conversion), infinities, NaN, signed zeros."""
    kernel = kernel_mode(kernel)
    n = 64
    x = torch.zeros(m, 64, dtype=torch.bfloat16)
    x[:, :2] = 1
    w = torch.zeros(n, 64)
    w[:, 0] = 1
    w[:, 1] = torch.arange(n) * 2.0**-8  # bf16-exact
    w = w.to(torch.bfloat16)
    want = (x.float() @ w.float().t()).bfloat16()
    assert torch.equal(amx.linear(x, amx.pack(w), kernel=kernel), want)
    special = [2.0**-130, -(2.0**-128), 3 * 2.0**-133, float("inf"), float("-inf"), -0.0, 0.0]
    edge = torch.tensor(special * (n // len(special)) + special[: n % len(special)])
    edge = edge.to(torch.bfloat16)
    zero_w = amx.pack(torch.zeros(n, 64, dtype=torch.bfloat16))
    zero_x = torch.zeros(m, 64, dtype=torch.bfloat16)
    want = (torch.zeros(m, n) + edge.float()).bfloat16()  # 0 + -0 is +0
    res = edge.expand(m, n).contiguous()
    for got in (amx.linear(zero_x, zero_w, bias=edge, kernel=kernel),
                amx.linear(zero_x, zero_w, residual=res, kernel=kernel)):  # fmt: skip
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan = edge.clone()
    nan[3] = float("nan")
    got = amx.linear(zero_x, zero_w, bias=nan, kernel=kernel)
    assert got[:, 3].isnan().all() and torch.equal(got[:, 4:], nan[4:].expand(m, n - 4))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 64, 300])
def test_float32_output_holds_the_bf16_values(kernel_mode, kernel, m):
    """``out_dtype=float32`` (the LM head's logits): each value the bf16 rounding of the
    float32 product (bias included), stored as float32; the bf16 output's values exactly."""
    kernel = kernel_mode(kernel)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
    w = (torch.randn(1024, 576, generator=g) * 576**-0.5).to(torch.bfloat16)
    bias = torch.randn(1024, generator=g).to(torch.bfloat16)
    wp = amx.pack(w)
    got = amx.linear(x, wp, bias=bias, kernel=kernel, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, 1024)
    assert torch.equal(got, got.bfloat16().float())  # bf16 values
    want = x.float() @ w.float().t() + bias.float()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    assert torch.equal(got, amx.linear(x, wp, bias=bias, kernel=kernel).float())
    with pytest.raises(AssertionError):
        amx.linear(x, wp, up=wp, kernel=kernel, out_dtype=torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [3, 40, 200, 224])
def test_packed_linear_reads_strided_rows(kernel_mode, kernel, m):
    """Rows of x some distance apart (a view into a wider activation); at prefill sizes (200,
    224) the AMX kernel reads them in place."""
    kernel = kernel_mode(kernel)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(m, 160, generator=g).to(torch.bfloat16)
    x = wide[:, 32:96]
    w = (torch.randn(64, 64, generator=g) * 0.1).to(torch.bfloat16)
    got = amx.linear(x, amx.pack(w), kernel=kernel)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), atol=1e-2, rtol=8e-3)


def test_pack_unpack_round_trip_and_shape():
    w = torch.randn(96, 64).to(torch.bfloat16)
    wp = amx.pack(w)
    assert wp.shape == (6, 2, 16, 32) and amx.is_packed(wp) and not amx.is_packed(w)
    assert torch.equal(amx.unpack(wp), w)
    assert not amx.packable(torch.randn(48, 64).to(torch.bfloat16))  # 48 rows: not 32-aligned
    assert not amx.packable(torch.randn(64, 64))  # float32


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_backend_adopts_a_model_and_gives_it_back(
    checkpoint, monkeypatch, kernel_mode, kernel
):
    """The whole model through PackedOps: every matrix packed for the tiles (or for oneDNN where
    its dims are not multiples of 32), the layer ops within bf16 rounding of the plain oneDNN
    ops on the same weights, and TorchOps restoring the dense weights bit for bit."""
    kernel = kernel_mode(kernel)
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    path = checkpoint("llama_gqa", intermediate_size=80)  # the MLP's dims: not 32-aligned
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setenv("KVSERVE_DISABLE_PREPACK", "1")
    model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 64)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.layers[0]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(21, cfg.hidden_size, generator=g).to(torch.bfloat16)
    res = torch.randn(21, cfg.hidden_size, generator=g).to(torch.bfloat16)
    ref = OneDNNOps(prepack=False)
    want = [ref.linear(x, layer.qkv_proj), ref.linear_add(x, layer.o_proj, res),
            ref.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res)]  # fmt: skip
    want_logits = ref.logits(x, model.lm_head)
    ops = PackedOps(kernel)
    model.set_ops(ops)
    kinds = {n: ("amx" if amx.is_packed(p) else "onednn" if p.layout == torch._mkldnn else "dense")
             for n, p in model.named_parameters()}  # fmt: skip
    assert kinds["layers.0.qkv_proj.weight"] == "amx"
    assert kinds["layers.0.mlp.down_proj.weight"] == "onednn"
    for n, p in dense.items():
        if "proj" in n or n == "lm_head.weight":
            aligned = p.shape[0] % 32 == 0 and p.shape[1] % 32 == 0
            if "gate_up" in n:
                aligned = (p.shape[0] // 2) % 32 == 0 and p.shape[1] % 32 == 0
            assert kinds[n] == ("amx" if aligned else "onednn"), n
    got = [ops.linear(x, layer.qkv_proj), ops.linear_add(x, layer.o_proj, res),
           ops.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res)]  # fmt: skip
    for w, o in zip(want, got, strict=True):
        torch.testing.assert_close(o.float(), w.float(), atol=3e-2, rtol=2e-2)
    # The LM head's logits, written as float32 by the kernel: still the bf16 values.
    logits = ops.logits(x, model.lm_head)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.bfloat16().float())
    torch.testing.assert_close(logits, want_logits, atol=3e-2, rtol=2e-2)
    # The norms before the projections: fused into the packed QKV GEMM, and left on their
    # own before the gate/up one this checkpoint keeps with oneDNN; the same bits either way.
    ln, post = RMSNorm(cfg.hidden_size, 1e-5), RMSNorm(cfg.hidden_size, 1e-6)
    for n in (ln, post):
        n.weight.data = (1 + 0.1 * torch.randn(cfg.hidden_size, generator=g)).to(torch.bfloat16)
    assert torch.equal(ops.norm_linear(ln, x, layer.qkv_proj),
                       ops.linear(ops.rms_norm(ln, x), layer.qkv_proj))  # fmt: skip
    assert torch.equal(
        ops.norm_swiglu_add(post, x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
        ops.swiglu_add(ops.rms_norm(post, x), layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
    )
    # The record the decode path reads instead of the parameters is the packed matrices
    # themselves, and only where the kernel takes them.
    for lin, gate_up in linear_layers(model):
        kw = lin.__dict__.get(KERNEL_WEIGHTS)
        assert (kw is not None) == amx.is_packed(lin.weight)
        if kw is not None:
            assert kw[0] is lin.weight and kw[2] is lin.bias
            assert kw[1] is (lin.up_weight if gate_up else None)
    model.set_ops(TorchOps())
    assert not any(KERNEL_WEIGHTS in lin.__dict__ for lin, _ in linear_layers(model))
    back = dict(model.named_parameters())
    assert back.keys() == dense.keys()
    for n, p in dense.items():
        assert torch.equal(back[n], p), n


@needs_avx512
@pytest.mark.parametrize("m", [1, 4, 5, 8, 12, 13, 64, 100, 300])
@pytest.mark.parametrize("k, n", [(64, 32), (512, 1536), (1536, 576), (576, 2496)])
def test_float32_kernel_matches_a_float64_reference(m, k, n):
    """Float32 weights in the kernel's own layout: plain, with a bias, a residual and
    SwiGLU's gate/up pair, within float32 rounding of the float64 product of the same inputs
    (register tiles of 1-4 and 5-12 rows, blocks of 96 rows, every column group), with rows
    read at a stride; and the layout round-trips bit for bit."""
    g = torch.Generator().manual_seed(m * 11 + k)
    wide = torch.randn(m, k + 32, generator=g)
    x = wide[:, 16 : 16 + k]  # rows k + 32 apart
    w = torch.randn(n, k, generator=g) * k**-0.5
    wu = torch.randn(n, k, generator=g) * k**-0.5
    bias = torch.randn(n, generator=g)
    res = torch.randn(m, n, generator=g)
    wp, wup = amx.pack(w), amx.pack(wu)
    assert wp.shape == (n // 16, k, 16) and amx.is_packed(wp) and not amx.is_packed(w)
    assert torch.equal(amx.unpack(wp), w)
    ref = x.double() @ w.double().t()
    cases = [
        (amx.linear(x, wp, kernel="avx512"), ref),
        (amx.linear(x, wp, bias=bias, kernel="avx512"), ref + bias.double()),
        (amx.linear(x, wp, residual=res, kernel="avx512"), ref + res.double()),
        (amx.linear(x, wp, up=wup, kernel="avx512"),
         F.silu(ref) * (x.double() @ wu.double().t())),
    ]  # fmt: skip
    for got, want in cases:
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@needs_avx512
def test_float32_backend_adopts_a_model_and_gives_it_back(checkpoint, monkeypatch):
    """A float32 model through the AVX-512 kernel's float32 tiles: every 32-aligned matrix
    in its layout (the rest with oneDNN), the layer ops and the logits within float32
    rounding of plain oneDNN on the same weights, and TorchOps restoring the dense weights
    bit for bit."""
    from kvserve.config import ModelConfig
    from kvserve.model import linear_ops
    from kvserve.model.loader import load_model

    path = checkpoint("llama_gqa", intermediate_size=80)  # the MLP's dims: not 32-aligned
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64)
    model.set_ops(TorchOps())
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.layers[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, cfg.hidden_size, generator=g)
    res = torch.randn(9, cfg.hidden_size, generator=g)
    ref = OneDNNOps(prepack=False)
    mlp = layer.mlp
    packed_qkv = torch.ops.mkldnn._reorder_linear_weight(
        layer.qkv_proj.weight.detach(), OneDNNOps.PACK_ROWS
    )

    def ref_linear(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed_qkv, None, "none", [], "")

    want = [ref.linear(x, layer.qkv_proj), ref.linear_add(x, layer.o_proj, res),
            ref.swiglu_add(x, mlp.gate_up_proj, mlp.down_proj, res),
            ref.logits(x, model.lm_head)]  # fmt: skip
    ops = select_ops(torch.device("cpu"), torch.float32)
    assert isinstance(ops, PackedOps) and ops.name == "avx512-f32"
    model.set_ops(ops)
    assert amx.is_packed(layer.qkv_proj.weight) and amx.is_packed(model.lm_head.weight)
    assert mlp.down_proj.weight.layout == torch._mkldnn  # 80 columns: oneDNN's
    got = [ops.linear(x, layer.qkv_proj), ops.linear_add(x, layer.o_proj, res),
           ops.swiglu_add(x, mlp.gate_up_proj, mlp.down_proj, res),
           ops.logits(x, model.lm_head)]  # fmt: skip
    for w, o in zip(want, got, strict=True):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)
    # Prefill-sized steps run oneDNN's float32 GEMM on its own packing: the reference's bits.
    big = torch.randn(ops.large_step_rows, cfg.hidden_size, generator=g)
    assert ops.large_step_rows > 9 and "oneDNN" in ops.describe()
    assert torch.equal(ops.linear(big, layer.qkv_proj), ref_linear(big))
    # Without room for that packing, the kernel takes every step size.
    monkeypatch.setattr(linear_ops, "available_memory", lambda: 1)
    tight = select_ops(torch.device("cpu"), torch.float32)
    model.set_ops(tight)
    assert tight.large_step_rows == 0 and "the kernel at every step size" in tight.describe()
    torch.testing.assert_close(tight.linear(big, layer.qkv_proj), ref_linear(big),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    model.set_ops(TorchOps())
    back = dict(model.named_parameters())
    for n, p in dense.items():
        assert torch.equal(back[n], p), n
