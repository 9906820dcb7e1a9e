"""FP8 block scaling through moe_engine.torch, on the CPU backend and (where a GPU is visible) on CUDA.

- The quantizers bit for bit against the rule of docs/design.md section 12, written here again in
  plain PyTorch (tile amax, epsilon, the multiplier m = 448 / amax capped at 2^126, pow2 multipliers,
  the scale s = 1 / m, all-zero and non-finite tiles, E4M3(v * m) with ties to even and saturation),
  for rows, per-expert columns (restarting at each expert's first token, zero padding, offsets) and
  128 x 128 weight blocks with their transpose.
- The three GEMMs against float64 matmuls of the dequantized operands (and, loosely, of the
  unquantized inputs), every bias mode and output dtype, wgrad's write / accumulate / overwrite.
- Errors, fake implementations (opcheck, FakeTensorMode), torch.compile(fullgraph=True), routing
  reuse, and on the GPU a captured quantize + forward + dgrad + wgrad step replayed with new routings.
"""

import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from moe_engine import _C
from reference import bounds, make_splits, needs_fp8_gemm, similarity_diff

E4M3 = torch.float8_e4m3fn
ops = torch.ops.moe_engine

# (splits, T, K, N): empty and 1-row experts, experts past one 128-token tile, K and N off a
# multiple of 128, one expert holding every token, G = 1 and G = 256, a tail no expert owns.
CASES = {
    "mixed": ([5, 0, 1, 37, 0, 130], 200, 48, 32),
    "off_tiles": ([129, 3, 200], 340, 272, 144),
    "one_expert_all": ([0, 0, 77, 0], 77, 64, 48),
    "g1": ([45], 50, 128, 16),
    "g256": ([(g * 7) % 5 for g in range(256)], 600, 32, 16),
    "all_empty": ([0, 0, 0], 9, 16, 16),
}
RECIPES = [(False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-3)]
RECIPE_IDS = ["plain", "pow2", "eps", "pow2-eps"]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def round_up(n, m):
    return (n + m - 1) // m * m


# ---- the rule, in plain PyTorch ----


def tile_scales(amax, finite, pow2, eps):
    """(multiplier, scale) of each tile from its amax (float32) and whether all its values are finite:
    m = 448 / amax (at most 2^126; pow2: rounded down to a power of two), s = 1 / m."""
    a = torch.maximum(amax, torch.tensor(eps, dtype=torch.float32))
    m = torch.full_like(a, 448.0) / a  # tensor operands: IEEE divisions, never a reciprocal multiply
    m = torch.clamp_max(m, 2.0**126)  # 448 / tiny amaxes overflow to inf
    if pow2:
        m = (m.view(torch.int32) & -0x800000).view(torch.float32)  # the mantissa cleared: rounded down
    m = torch.where(a == 0, torch.ones_like(m), m)
    s = torch.ones_like(m) / m
    nan = torch.full_like(m, float("nan"))
    return torch.where(finite, m, nan), torch.where(finite, s, nan)


def quantize_values(v, m, finite):
    """E4M3 bytes of v * m (float32; m broadcast to v), saturated at 448, NaN (0x7f) in non-finite tiles."""
    q = (v * m.expand_as(v)).clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)
    return torch.where(finite.expand_as(v), q, torch.full_like(q, 0x7F))


def tiles_along_last(v):
    """v [..., L] float32 -> [..., ceil(L/128), 128], zero padded (zeros change no amax)."""
    L = v.shape[-1]
    v = torch.nn.functional.pad(v, (0, round_up(L, 128) - L))
    return v.reshape(*v.shape[:-1], v.shape[-1] // 128, 128)


def ref_rows(x, rows, pow2, eps):
    """(bytes [rows, K] uint8, scales [rows, ceil(K/128)]) of the first `rows` rows of x."""
    K = x.shape[1]
    v = tiles_along_last(x[:rows].float())
    finite = torch.isfinite(v).all(-1)
    amax = torch.where(finite, v.abs().amax(-1), torch.zeros_like(finite, dtype=torch.float32))
    m, s = tile_scales(amax, finite, pow2, eps)
    q = quantize_values(v, m[..., None], finite[..., None])
    return q.reshape(rows, v.shape[1] * 128)[:, :K], s


def ref_columns(x, splits, pow2, eps):
    """(bytes [K, C] uint8, scales [C/128, K], offsets [G+1]) of the columnwise layout; columns
    past the last expert's segment stay zero here (the quantizer leaves them unwritten)."""
    T, K = x.shape
    G = len(splits)
    C = round_up(T + 127 * G, 128)
    data = torch.zeros(K, C, dtype=torch.uint8)
    scales = torch.zeros(C // 128, K)
    offsets, row, col = [0], 0, 0
    for n in splits:
        for j in range(0, n, 128):
            tile = x[row + j : row + min(n, j + 128)].float()  # [m, K], the tokens of one tile
            finite = torch.isfinite(tile).all(0)
            m, s = tile_scales(torch.where(finite, tile.abs().amax(0), torch.zeros(K)), finite, pow2, eps)
            q = quantize_values(tile, m[None, :], finite[None, :])
            data[:, col + j : col + j + tile.shape[0]] = q.T
            scales[(col + j) // 128] = s
        row += n
        col += round_up(n, 128)
        offsets.append(col)
    return data, scales, offsets


def ref_weight(w, pow2, eps):
    """(bytes [G, N, K], scales [G, ceil(N/128), ceil(K/128)]) in 128 x 128 blocks."""
    G, N, K = w.shape
    v = torch.nn.functional.pad(w.float(), (0, round_up(K, 128) - K, 0, round_up(N, 128) - N))
    v = v.reshape(G, v.shape[1] // 128, 128, v.shape[2] // 128, 128)
    finite = torch.isfinite(v).all(4).all(2)
    amax = torch.where(finite, v.abs().amax((2, 4)), torch.zeros_like(finite, dtype=torch.float32))
    m, s = tile_scales(amax, finite, pow2, eps)
    q = quantize_values(v, m[:, :, None, :, None], finite[:, :, None, :, None])
    return q.reshape(G, v.shape[1] * 128, v.shape[3] * 128)[:, :N, :K], s


def same_scales(got, want):
    """Bit-identical float32 scales, any NaN matching any NaN."""
    got, want = got.cpu(), want.cpu()
    nan = got.isnan() & want.isnan()
    return bool((nan | (got.view(torch.int32) == want.view(torch.int32))).all())


def first_mismatch(got, want):
    bad = (got != want).nonzero()
    return f"{len(bad)} mismatches, first at {bad[0].tolist()}" if len(bad) else "none"


def test_the_reference_rounds_e4m3_as_the_format_says():
    """The reference's E4M3 conversion on the cases that decide it: ties to even (normal and
    subnormal), the smallest normal, saturation, the sign of zero."""
    sub = 2.0**-9
    cases = [(1.0625, 0x38), (1.1875, 0x3A), (-1.1875, 0xBA), (sub, 0x01), (sub / 2, 0x00), (1.5 * sub, 0x02),
             (2.5 * sub, 0x02), (7.5 * sub, 0x08), (2.0**-6, 0x08), (424.0, 0x7D), (432.0, 0x7E), (448.0, 0x7E),
             (1e30, 0x7E), (-1e30, 0xFE), (-0.0, 0x80), (-1e-30, 0x80)]
    v = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    got = quantize_values(v, torch.ones(1), torch.ones(1, dtype=torch.bool)).tolist()
    assert got == [c[1] for c in cases]


# ---- inputs ----


def activation(T, K, dtype, device, seed, special=True):
    """x [T, K] with the tiles that exercise the rule: zero, tiny (below the 2^-126 floor where the
    dtype reaches it), ties at an exact scale of 1, saturating, inf and NaN, huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * torch.exp(torch.randn(T, 1, generator=g) * 2)
    if special and T >= 8:
        x[0, :16] = 0.0  # a zero tile when K <= 16, else part of one
        x[1, :] = 0.0  # zero tiles
        x[2, :] = torch.randn(K, generator=g) * (1e-38 if dtype != torch.float16 else 1e-6)  # tiny tiles
        ties = torch.tensor([448.0, 1.0625, 1.1875, 432.0, 2.0**-10, 1.5 * 2.0**-9, -1.1875, -424.0])
        x[3, :] = 1.0
        x[3, : min(K, 8)] = ties[: min(K, 8)]  # amax 448: multiplier 1, so v * m are these exact ties
        x[4, K // 2] = float("inf")
        x[5, K - 1] = float("nan")
        x[6, :] *= 1e30 if dtype != torch.float16 else 1e3  # large tiles
    return x.to(dtype=dtype).to(device)


# ---- the quantizers ----


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_quantize_rows_and_columns_follow_the_rule(device, case, recipe):
    splits_list, T, K, _ = CASES[case]
    pow2, eps = recipe
    rows = sum(splits_list)
    splits = make_splits(splits_list, device)
    for i, dtype in enumerate(INPUT_DTYPES):
        x = activation(T, K, dtype, device, seed=i)
        both = me.quantize_fp8(x, splits, rowwise=True, columnwise=True, pow2_scales=pow2, amax_epsilon=eps)
        assert both.num_tokens == T and both.shape == (T, K)
        r, c = both.rows, both.columns
        S, C = me.fp8_scales_pitch(T), me.fp8_columns_capacity(T, len(splits_list))
        assert (r.data.shape, r.data.dtype) == ((T, K), E4M3)
        assert (r.scales.shape, r.scales.dtype) == ((math.ceil(K / 128), S), torch.float32)
        assert (c.data.shape, c.data.dtype) == ((K, C), E4M3)
        assert (c.scales.shape, c.scales.dtype, c.offsets.shape, c.offsets.dtype) == ((C // 128, K), torch.float32,
                                                                                      (len(splits_list) + 1,),
                                                                                      torch.int64)
        xc = x.cpu()
        want_q, want_s = ref_rows(xc, rows, pow2, eps)
        got_q = r.data.cpu().view(torch.uint8)[:rows]
        assert torch.equal(got_q, want_q), f"{dtype} rows data: {first_mismatch(got_q, want_q)}"
        assert same_scales(r.scales[:, :rows].T, want_s), f"{dtype} rows scales"

        want_cq, want_cs, want_off = ref_columns(xc, splits_list, pow2, eps)
        end = want_off[-1]
        assert c.offsets.cpu().tolist() == want_off
        got_cq = c.data.cpu().view(torch.uint8)[:, :end]
        assert torch.equal(got_cq, want_cq[:, :end]), f"{dtype} columns data: {first_mismatch(got_cq, want_cq[:, :end])}"
        assert same_scales(c.scales[: end // 128], want_cs[: end // 128]), f"{dtype} columns scales"

        # One pass for both forms gives what each form alone gives.
        alone_r = me.quantize_fp8(x, splits, pow2_scales=pow2, amax_epsilon=eps)
        alone_c = me.quantize_fp8(x, splits, rowwise=False, columnwise=True, pow2_scales=pow2, amax_epsilon=eps)
        assert alone_r.columns is None and alone_c.rows is None
        assert torch.equal(alone_r.rows.data.view(torch.uint8)[:rows], r.data.view(torch.uint8)[:rows])
        assert same_scales(alone_r.rows.scales[:, :rows], r.scales[:, :rows])
        assert torch.equal(alone_c.columns.data.view(torch.uint8)[:, :end], c.data.view(torch.uint8)[:, :end])
        assert same_scales(alone_c.columns.scales[: end // 128], c.scales[: end // 128])


def test_quantize_reads_row_strided_x(device):
    splits_list, T, K, _ = CASES["mixed"]
    splits = make_splits(splits_list, device)
    wide = activation(T, 96, torch.bfloat16, device, seed=3)
    strided = wide[:, :K]
    assert not strided.is_contiguous()
    a = me.quantize_fp8(strided, splits, columnwise=True)
    b = me.quantize_fp8(strided.contiguous(), splits, columnwise=True)
    rows, end = sum(splits_list), a.columns.offsets[-1].item()
    assert torch.equal(a.rows.data.view(torch.uint8)[:rows], b.rows.data.view(torch.uint8)[:rows])
    assert torch.equal(a.columns.data.view(torch.uint8)[:, :end], b.columns.data.view(torch.uint8)[:, :end])


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-expert"])
def test_quantize_weight_follows_the_rule(device, recipe, packed):
    pow2, eps = recipe
    G, N, K = 3, 144, 272
    for i, dtype in enumerate(INPUT_DTYPES):
        g = torch.Generator().manual_seed(10 + i)
        w = torch.randn(G, N, K, generator=g) * 0.05
        w[0, :128, :128] = 0.0  # a zero block
        w[1, 130, 5] = float("inf")  # a non-finite block (rows 128.., columns 0..127 of expert 1)
        w[2, :16, 256:] = 1e-38 if dtype != torch.float16 else 1e-6  # a tiny partial block
        w = w.to(dtype=dtype).to(device)
        w8 = me.quantize_fp8_weight(w if packed else list(w.unbind(0)), pow2_scales=pow2, amax_epsilon=eps)
        want_q, want_s = ref_weight(w.cpu(), pow2, eps)
        assert (w8.data.shape, w8.data.dtype, w8.scales.shape) == ((G, N, K), E4M3, (G, 2, 3))
        assert (w8.data_t.shape, w8.scales_t.shape) == ((G, K, N), (G, 3, 2))
        got = w8.data.cpu().view(torch.uint8)
        assert torch.equal(got, want_q), f"{dtype} data: {first_mismatch(got, want_q)}"
        assert same_scales(w8.scales, want_s), f"{dtype} scales"
        got_t = w8.data_t.cpu().view(torch.uint8)
        assert torch.equal(got_t, want_q.transpose(1, 2)), f"{dtype} data_t"
        assert same_scales(w8.scales_t, want_s.transpose(1, 2)), f"{dtype} scales_t"
        only_data = me.quantize_fp8_weight(w, columnwise=False, pow2_scales=pow2, amax_epsilon=eps)
        only_t = me.quantize_fp8_weight(w, rowwise=False, pow2_scales=pow2, amax_epsilon=eps)
        assert only_data.data_t is None and only_data.scales_t is None and only_t.data is None
        assert torch.equal(only_data.data.view(torch.uint8), w8.data.view(torch.uint8))
        assert torch.equal(only_t.data_t.view(torch.uint8), w8.data_t.view(torch.uint8))


def test_quantize_is_deterministic_and_takes_int32_splits(device):
    splits_list, T, K, _ = CASES["off_tiles"]
    x = activation(T, K, torch.bfloat16, device, seed=4)
    a = me.quantize_fp8(x, make_splits(splits_list, device), columnwise=True)
    b = me.quantize_fp8(x, make_splits(splits_list, device, torch.int32), columnwise=True)
    rows, end = sum(splits_list), a.columns.offsets[-1].item()
    assert torch.equal(a.rows.data.view(torch.uint8)[:rows], b.rows.data.view(torch.uint8)[:rows])
    assert same_scales(a.rows.scales[:, :rows], b.rows.scales[:, :rows])
    assert torch.equal(a.columns.data.view(torch.uint8)[:, :end], b.columns.data.view(torch.uint8)[:, :end])
    assert torch.equal(a.columns.offsets, b.columns.offsets)


# ---- the GEMMs ----


def deq_rows(r, rows):
    """float64 [rows, K] of an Fp8Rows."""
    q = r.data[:rows].cpu().double()
    s = r.scales[:, :rows].cpu().double().T.repeat_interleave(128, 1)[:, : q.shape[1]]
    return q * s


def deq_columns(c):
    """float64 [K, C] of an Fp8Columns."""
    return c.data.cpu().double() * c.scales.cpu().double().T.repeat_interleave(128, 1)


def deq_blocks(data, scales):
    """float64 [G, R, S] of 128 x 128 blocks."""
    q = data.cpu().double()
    s = scales.cpu().double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return q * s[:, : q.shape[1], : q.shape[2]]


def check_gemm(got, want, out_dtype, device, what):
    """got vs the float64 product of the dequantized operands. CPU: max |got - want| / rms(want)
    within the float32 rounding of the block sums (the exact products summed in float32). GPU: the
    C++ GPU suite's bounds (tests/cpp/test_gpu_fp8_gemm.cpp): the tensor core keeps about 14 bits
    while it sums a 128-long block, so the error norm / the output's norm <= 1e-3 (float32 outputs;
    4e-3 bfloat16) and the worst element <= 3% of the output's rms. bfloat16 outputs add half an
    ulp of each value."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if want.numel() == 0:
        return
    assert not got.isnan().any(), f"{what}: NaN"
    rms = want.square().mean().sqrt().clamp_min(1e-30)
    rounding = 2.0**-8 * want.abs() if out_dtype == torch.bfloat16 else torch.zeros_like(want)
    worst = (((got - want).abs() - rounding).max() / rms).item()
    if device.type == "cpu":
        assert worst <= 1e-5, f"{what}: max error / rms {worst:.3g} > 1e-05"
        return
    norm = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    norm_bound = 1e-3 if out_dtype == torch.float32 else 4e-3
    assert norm <= norm_bound, f"{what}: error norm / norm {norm:.3g} > {norm_bound:.3g}"
    assert worst <= 3e-2, f"{what}: max error / rms {worst:.3g} > 0.03"


def problem(case, device, seed=0):
    splits_list, T, K, N = CASES[case]
    G = len(splits_list)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(G, N, K, generator=g) * K**-0.5).to(device, torch.bfloat16)
    dy = torch.randn(T, N, generator=g).to(device, torch.bfloat16)
    return splits_list, make_splits(splits_list, device), x, w, dy


GEMM_CASES = ["mixed", "off_tiles", "one_expert_all", "g1", "g256", "all_empty"]


@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("bias_mode", ["none", "bias", "scale_bias"])
def test_forward_matches_float64_of_the_dequantized_operands(device, case, bias_mode):
    needs_fp8_gemm(device)
    splits_list, splits, x, w, _ = problem(case, device)
    T, K = x.shape
    G, N = w.shape[0], w.shape[1]
    rows, off = sum(splits_list), bounds(splits_list)
    x8, w8 = me.quantize_fp8(x, splits), me.quantize_fp8_weight(w)
    g = torch.Generator().manual_seed(1)
    b = torch.randn(G, N, generator=g).to(device, torch.bfloat16) if bias_mode != "none" else None
    p = torch.rand(T, generator=g).to(device) if bias_mode == "scale_bias" else None
    xq, wq = deq_rows(x8.rows, rows), deq_blocks(w8.data, w8.scales)
    want = torch.zeros(rows, N, dtype=torch.float64)
    plain = torch.zeros(rows, N, dtype=torch.float64)  # the unquantized inputs
    for e in range(G):
        a, z = off[e], off[e + 1]
        want[a:z] = xq[a:z] @ wq[e].T
        plain[a:z] = x[a:z].cpu().double() @ w[e].cpu().double().T
        if b is not None:
            be = b[e].cpu().double()
            extra = be if p is None else p[a:z, None].cpu().double() * be
            want[a:z] += extra
            plain[a:z] += extra
    for out_dtype in (torch.float32, torch.bfloat16):
        y = me.grouped_linear_fp8(x8, w8, splits, bias=b, row_scale=p, out_dtype=out_dtype)
        assert y.shape == (T, N) and y.dtype == out_dtype and y.device.type == device.type
        check_gemm(y[:rows], want, out_dtype, device, f"y {out_dtype}")
        assert similarity_diff(y[:rows], plain) < 1e-3
        assert torch.all(y[rows:] == 0), "rows past sum(splits) of a fresh output are zeros"
        assert torch.equal(y, me.grouped_linear_fp8(x8, w8, splits, bias=b, row_scale=p, out_dtype=out_dtype))


def test_forward_takes_per_expert_bias(device):
    needs_fp8_gemm(device)
    splits_list, splits, x, w, _ = problem("mixed", device)
    b = torch.randn(w.shape[0], w.shape[1]).to(device, torch.bfloat16)
    x8, w8 = me.quantize_fp8(x, splits), me.quantize_fp8_weight(w)
    packed = me.grouped_linear_fp8(x8, w8, splits, bias=b)
    assert torch.equal(me.grouped_linear_fp8(x8, w8, splits, bias=list(b.unbind(0))), packed)


@pytest.mark.parametrize("case", GEMM_CASES)
def test_dgrad_matches_float64_of_the_dequantized_operands(device, case):
    needs_fp8_gemm(device)
    splits_list, splits, _, w, dy = problem(case, device)
    T, N = dy.shape
    K = w.shape[2]
    rows, off = sum(splits_list), bounds(splits_list)
    dy8, w8 = me.quantize_fp8(dy, splits), me.quantize_fp8_weight(w)
    dyq, wtq = deq_rows(dy8.rows, rows), deq_blocks(w8.data_t, w8.scales_t)
    want = torch.zeros(rows, K, dtype=torch.float64)
    plain = torch.zeros(rows, K, dtype=torch.float64)
    for e in range(len(splits_list)):
        a, z = off[e], off[e + 1]
        want[a:z] = dyq[a:z] @ wtq[e].T
        plain[a:z] = dy[a:z].cpu().double() @ w[e].cpu().double()
    for out_dtype in (torch.float32, torch.bfloat16):
        dx = me.grouped_linear_fp8_dgrad(dy8, w8, splits, out_dtype=out_dtype)
        assert dx.shape == (T, K) and dx.dtype == out_dtype
        check_gemm(dx[:rows], want, out_dtype, device, f"dx {out_dtype}")
        assert similarity_diff(dx[:rows], plain) < 1e-3
        assert torch.all(dx[rows:] == 0)


def wgrad_reference(dy8, x8, splits_list):
    """float64 [G, N, K] from the columnwise forms: each expert's segment of columns."""
    dyq, xq = deq_columns(dy8.columns), deq_columns(x8.columns)
    off = dy8.columns.offsets.cpu().tolist()
    return torch.stack([dyq[:, off[e] : off[e] + n] @ xq[:, off[e] : off[e] + n].T for e, n in enumerate(splits_list)])


@pytest.mark.parametrize("case", GEMM_CASES)
def test_wgrad_write_accumulate_overwrite(device, case):
    needs_fp8_gemm(device)
    splits_list, splits, x, w, dy = problem(case, device)
    G, N, K = w.shape
    off = bounds(splits_list)
    x8 = me.quantize_fp8(x, splits, rowwise=False, columnwise=True)
    dy8 = me.quantize_fp8(dy, splits, rowwise=False, columnwise=True)
    want = wgrad_reference(dy8, x8, splits_list)
    plain = torch.stack([dy[off[e] : off[e + 1]].cpu().double().T @ x[off[e] : off[e + 1]].cpu().double()
                         for e in range(G)])
    empty = [e for e, n in enumerate(splits_list) if n == 0]
    for out_dtype in (torch.float32, torch.bfloat16):
        dw = me.grouped_linear_fp8_wgrad(dy8, x8, splits, out_dtype=out_dtype)
        assert dw.shape == (G, N, K) and dw.dtype == out_dtype
        check_gemm(dw, want, out_dtype, device, f"dW {out_dtype}")
        assert similarity_diff(dw, plain) < 1e-3
        assert all(torch.all(dw[e] == 0) for e in empty), "an empty expert's gradient is zeros"
    g = torch.Generator().manual_seed(2)
    start = torch.randn(G, N, K, generator=g).to(device)
    main = start.clone()
    assert me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=main, mode="accumulate") is main
    check_gemm(main.double() - start.double(), want, torch.float32, device, "accumulate")
    assert all(torch.equal(main[e], start[e]) for e in empty), "accumulate leaves an empty expert untouched"
    over = start.clone()
    me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=over, mode="overwrite")
    check_gemm(over, want, torch.float32, device, "overwrite")
    assert all(torch.all(over[e] == 0) for e in empty), "overwrite zeroes an empty expert"


def test_wgrad_into_per_expert_buffers(device):
    needs_fp8_gemm(device)
    splits_list, splits, x, w, dy = problem("mixed", device)
    x8 = me.quantize_fp8(x, splits, rowwise=False, columnwise=True)
    dy8 = me.quantize_fp8(dy, splits, rowwise=False, columnwise=True)
    packed = me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=torch.zeros(w.shape, device=device), mode="accumulate")
    experts = [torch.zeros(w.shape[1:], device=device) for _ in range(w.shape[0])]
    me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=experts, mode="accumulate")
    assert torch.equal(torch.stack(experts), packed)


def test_wgrad_into_a_buffer_that_requires_grad_is_refused_under_grad_mode(device):
    """A main_grad-like target that requires grad (a parameter passed by mistake) would be written
    outside autograd: refused while grad mode is on, written under torch.no_grad()."""
    needs_fp8_gemm(device)
    splits_list, splits, x, w, dy = problem("mixed", device)
    x8 = me.quantize_fp8(x, splits, rowwise=False, columnwise=True)
    dy8 = me.quantize_fp8(dy, splits, rowwise=False, columnwise=True)
    target = torch.nn.Parameter(torch.zeros(w.shape, device=device))
    with pytest.raises(ValueError, match=r"grouped_linear_fp8_wgrad: out requires grad \(a parameter\?\)"):
        me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=target, mode="accumulate")
    assert not target.detach().any()
    with torch.no_grad():
        me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=target, mode="accumulate")
    assert torch.equal(target.detach(), me.grouped_linear_fp8_wgrad(dy8, x8, splits, out_dtype=torch.float32))


def test_the_gemms_reuse_the_quantizers_routing(device):
    """quantize_fp8 computes the group offsets once; the GEMMs given the same splits reuse them;
    a copy of the splits (another buffer) is not trusted, and gives the same results."""
    needs_fp8_gemm(device)
    splits_list, splits, x, w, dy = problem("off_tiles", device)
    w8 = me.quantize_fp8_weight(w)

    def step(s_fwd, s_bwd):
        start = _C.group_layout_computations()
        x8 = me.quantize_fp8(x, splits, columnwise=True)
        y = me.grouped_linear_fp8(x8, w8, s_fwd)
        dy8 = me.quantize_fp8(dy, splits, columnwise=True)
        dx = me.grouped_linear_fp8_dgrad(dy8, w8, s_bwd)
        dw = me.grouped_linear_fp8_wgrad(dy8, x8, s_bwd, out_dtype=torch.float32)
        return _C.group_layout_computations() - start, (y, dx, dw)

    count, reused = step(splits, splits)
    assert count == 2, f"{count} GroupLayout computations for two quantizations"
    count, copied = step(splits.clone(), splits.clone())
    assert count == 5
    for a, b in zip(reused, copied):
        assert torch.equal(a, b)


def test_operands_of_overwritten_or_other_splits_are_refused(device):
    """An FP8 operand is laid out by the splits it was quantized with (its columns by their offsets,
    its rows only up to their sum). One quantized before new values were written into its splits
    tensor in place, or a wgrad pair quantized with different splits, would be read by another
    routing than its own: a clear error instead of a wrong result or unwritten memory."""
    needs_fp8_gemm(device)
    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 32, generator=g).to(device, bf16)
    dy = torch.randn(8, 32, generator=g).to(device, bf16)
    w8 = me.quantize_fp8_weight(torch.randn(2, 32, 32, generator=g).to(device, bf16))
    s = make_splits([3, 5], device)
    x8, dy8 = me.quantize_fp8(x, s, columnwise=True), me.quantize_fp8(dy, s, columnwise=True)
    want = me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32)  # one splits tensor: fine
    other = make_splits([8, 0], device)
    for a, b in ((dy8, me.quantize_fp8(x, other, columnwise=True)), (me.quantize_fp8(dy, other, columnwise=True), x8)):
        with pytest.raises(ValueError, match=r"grouped_linear_fp8_wgrad: dy and x were quantized with different splits"):
            me.grouped_linear_fp8_wgrad(a, b, s, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8_wgrad: dy was quantized for G = 2 experts .*, but "
                                         r"splits has G = 3"):
        me.grouped_linear_fp8_wgrad(dy8, x8, make_splits([2, 2, 4], device))
    assert torch.equal(me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32), want)

    with torch.no_grad():
        s.copy_(other)  # the same buffer, new values
    stale = "was quantized with splits whose values have been overwritten in place since"
    with pytest.raises(ValueError, match=f"grouped_linear_fp8: x {stale}"):
        me.grouped_linear_fp8(x8, w8, s)
    with pytest.raises(ValueError, match=f"grouped_linear_fp8_dgrad: dy {stale}"):
        me.grouped_linear_fp8_dgrad(dy8, w8, s)
    with pytest.raises(ValueError, match=f"grouped_linear_fp8_wgrad: dy {stale}"):
        me.grouped_linear_fp8_wgrad(dy8, x8, s)
    # The ops themselves refuse the routing of such an operand (torch.ops, torch.compile).
    with pytest.raises(ValueError, match=f"grouped_linear_fp8: x {stale}"):
        torch.ops.moe_engine.grouped_linear_fp8(x8.rows.data, x8.rows.scales, w8.data, w8.scales, s, [], None, bf16,
                                                x8.routing)
    with pytest.raises(ValueError, match=f"grouped_linear_fp8_wgrad: an operand \\(dy or x\\) {stale}"):
        c = dy8.columns
        torch.ops.moe_engine.grouped_linear_fp8_wgrad_(c.data, c.scales, c.offsets, x8.columns.data, x8.columns.scales,
                                                       x8.columns.offsets, s, 8, [torch.zeros(2, 32, 32, device=device)],
                                                       "write", dy8.routing)
    # Quantized again with the splits as they are: the results of a fresh splits tensor.
    x8, dy8 = me.quantize_fp8(x, s, columnwise=True), me.quantize_fp8(dy, s, columnwise=True)
    y8, yd8 = me.quantize_fp8(x, other, columnwise=True), me.quantize_fp8(dy, other, columnwise=True)
    assert torch.equal(me.grouped_linear_fp8(x8, w8, s), me.grouped_linear_fp8(y8, w8, other))
    assert torch.equal(me.grouped_linear_fp8_dgrad(dy8, w8, s), me.grouped_linear_fp8_dgrad(yd8, w8, other))
    assert torch.equal(me.grouped_linear_fp8_wgrad(dy8, x8, s), me.grouped_linear_fp8_wgrad(yd8, y8, other))


# ---- errors ----


def test_bad_inputs_are_clear_errors(device):
    bf16 = torch.bfloat16
    s = make_splits([4, 0, 5], device)
    x = torch.randn(10, 32, device=device, dtype=bf16)
    w = torch.randn(3, 16, 32, device=device, dtype=bf16)
    with pytest.raises(ValueError, match=r"quantize_fp8: x: expected bfloat16, float16 or float32, got float64"):
        me.quantize_fp8(x.double(), s)
    with pytest.raises(ValueError, match=r"quantize_fp8: K = 40 \(x's features\) is not a multiple of 16"):
        me.quantize_fp8(torch.randn(10, 40, device=device, dtype=bf16), s)
    with pytest.raises(ValueError, match=r"quantize_fp8: x: expected a 2-D \[T, \.\.\.\] token tensor"):
        me.quantize_fp8(x.reshape(2, 5, 32), s)
    with pytest.raises(ValueError, match=r"quantize_fp8: recipe.amax_epsilon: expected a finite value >= 0, got -1"):
        me.quantize_fp8(x, s, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match=r"quantize_fp8: neither rows nor columns are requested"):
        me.quantize_fp8(x, s, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match=r"splits must be an int64 or int32 tensor .*, got torch.int16"):
        me.quantize_fp8(x, s.to(torch.int16))
    with pytest.raises(TypeError, match=r"quantize_fp8: x: expected a \[T, K\] tensor, got list"):
        me.quantize_fp8([x], s)
    with pytest.raises(ValueError, match=r"quantize_fp8_weight: N = 40 \(the weight's rows\) is not a multiple of 16"):
        me.quantize_fp8_weight(torch.randn(3, 40, 32, device=device, dtype=bf16))
    with pytest.raises(ValueError, match=r"quantize_fp8_weight: weight: expected bfloat16, float16 or float32, got"):
        me.quantize_fp8_weight(w.double())
    with pytest.raises(ValueError, match=r"quantize_fp8_weight: weight: required per-expert tensor \[N, K\] is undefined"):
        me.quantize_fp8_weight([])
    if device.type == "cpu":
        with pytest.raises(ValueError, match="negative"):
            me.quantize_fp8(x, make_splits([4, -1, 5], device))
        with pytest.raises(ValueError, match="exceeds the buffer capacity"):
            me.quantize_fp8(x, make_splits([4, 4, 5], device))

    x8 = me.quantize_fp8(x, s, columnwise=True)
    w8 = me.quantize_fp8_weight(w)
    dy8 = me.quantize_fp8(torch.randn(10, 16, device=device, dtype=bf16), s, columnwise=True)
    # What the Python layer can tell: the wrong kind of argument, a form that was not made.
    with pytest.raises(TypeError, match=r"grouped_linear_fp8: x: expected an Fp8Tensor \(from "
                                        r"moe_engine.torch.quantize_fp8\), got Tensor"):
        me.grouped_linear_fp8(x, w8, s)
    with pytest.raises(TypeError, match=r"grouped_linear_fp8_dgrad: weight: expected an Fp8Weight"):
        me.grouped_linear_fp8_dgrad(dy8, w, s)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8: x: the forward reads the rowwise form, but x has none"):
        me.grouped_linear_fp8(me.quantize_fp8(x, s, rowwise=False, columnwise=True), w8, s)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8_dgrad: weight: dgrad reads the transposed copy"):
        me.grouped_linear_fp8_dgrad(dy8, me.quantize_fp8_weight(w, columnwise=False), s)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8: weight: the forward reads weight.data, but it is None"):
        me.grouped_linear_fp8(x8, me.quantize_fp8_weight(w, rowwise=False), s)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8_wgrad: x: wgrad reads the columnwise form"):
        me.grouped_linear_fp8_wgrad(dy8, me.quantize_fp8(x, s), s)
    with pytest.raises(ValueError, match=r"grouped_linear_fp8_wgrad: dy and x were quantized from token buffers of "
                                         r"T = 10 and T = 12 rows"):
        me.grouped_linear_fp8_wgrad(dy8, me.quantize_fp8(torch.randn(12, 32, device=device, dtype=bf16), s,
                                                         columnwise=True), s)
    # What the C++ ops check, named by the op and the argument.
    with pytest.raises(ValueError, match=r"grouped_linear_forward: y: expected bfloat16 or float32, got float16"):
        me.grouped_linear_fp8(x8, w8, s, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"grouped_linear_dgrad: dx: expected bfloat16 or float32, got float16"):
        me.grouped_linear_fp8_dgrad(dy8, w8, s, out_dtype=torch.float16)
    w8_wide = me.quantize_fp8_weight(torch.randn(3, 16, 64, device=device, dtype=bf16))
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x.data: expected \[T, K\] = \[10, 64\], got"):
        me.grouped_linear_fp8(x8, w8_wide, s)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: weight.data has G = 3 experts but the group "
                                         r"layout has G = 2"):
        me.grouped_linear_fp8(x8, w8, make_splits([4, 5], device))
    with pytest.raises(ValueError, match=r"grouped_linear_forward: row_scale \(scale_bias\) is given but there is no bias"):
        me.grouped_linear_fp8(x8, w8, s, row_scale=torch.rand(10, device=device))
    with pytest.raises(ValueError, match=r"grouped_linear_forward: bias: expected G x \[N\] = 3 x \[16\]"):
        me.grouped_linear_fp8(x8, w8, s, bias=torch.zeros(3, 8, device=device, dtype=bf16))
    with pytest.raises(ValueError, match=r"grouped_linear_wgrad: dweight: accumulate mode writes a float32 main_grad, "
                                         r"got bfloat16"):
        me.grouped_linear_fp8_wgrad(dy8, x8, s, out=torch.zeros(3, 16, 32, device=device, dtype=bf16),
                                    mode="accumulate")
    with pytest.raises(ValueError, match=r"grouped_linear_wgrad: dweight has G = 2 experts but the group layout has G = 3"):
        me.grouped_linear_fp8_wgrad(dy8, x8, s, out=torch.zeros(2, 16, 32, device=device))
    # dweight sets N and K: operands of other widths are the ones named.
    with pytest.raises(ValueError, match=r"grouped_linear_wgrad: dy.data: expected \[N, C\] = \[32, 512\], got "
                                         r"float8_e4m3\[16, 512\]"):
        me.grouped_linear_fp8_wgrad(dy8, x8, s, out=torch.zeros(3, 32, 16, device=device))
    with pytest.raises(ValueError, match=r"unknown gradient mode 'add'; expected write, accumulate or overwrite"):
        me.grouped_linear_fp8_wgrad(dy8, x8, s, mode="add")
    # Operands put together by hand are checked like any other.
    forged = me.Fp8Tensor(me.Fp8Rows(x8.rows.data, x8.rows.scales.half()), None, 10)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x.scales: expected float32, got float16"):
        me.grouped_linear_fp8(forged, w8, s)
    short = me.Fp8Tensor(me.Fp8Rows(x8.rows.data, x8.rows.scales[:, :8]), None, 10)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x.scales: expected a pitch S >= T = 10"):
        me.grouped_linear_fp8(short, w8, s)
    as_bytes = me.Fp8Tensor(me.Fp8Rows(x8.rows.data.view(torch.uint8), x8.rows.scales), None, 10)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x.data: expected float8_e4m3, got uint8"):
        me.grouped_linear_fp8(as_bytes, w8, s)


def test_tensors_on_another_device_are_named(cuda):
    s = make_splits([4, 0, 5], cuda)
    x = torch.randn(10, 32, device=cuda, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantize_fp8: x is on cpu; expected the group layout's device cuda"):
        me.quantize_fp8(x.cpu(), s)
    w8_cpu = me.quantize_fp8_weight(torch.randn(3, 16, 32, dtype=torch.bfloat16))
    x8 = me.quantize_fp8(x, s)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: weight.data is on cpu; expected the group layout's"):
        me.grouped_linear_fp8(x8, w8_cpu, s)


# ---- fake implementations, torch.compile ----


def op_cases():
    torch.manual_seed(5)
    x, s = torch.randn(12, 32, dtype=torch.bfloat16), torch.tensor([4, 0, 5])
    w, dy = torch.randn(3, 16, 32, dtype=torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16)
    x8 = me.quantize_fp8(x, s, columnwise=True)
    dy8 = me.quantize_fp8(dy, s, columnwise=True)
    w8 = me.quantize_fp8_weight(w)
    b, p = torch.randn(3, 16, dtype=torch.bfloat16), torch.rand(12)
    xr, dyr, xc, dyc = x8.rows, dy8.rows, x8.columns, dy8.columns
    cols = (dyc.data, dyc.scales, dyc.offsets, xc.data, xc.scales, xc.offsets, s, 12)
    return [
        (ops.quantize_fp8, (x, s, True, True, False, 0.0)),
        (ops.quantize_fp8, (x.float(), s, True, False, True, 1e-4)),
        (ops.quantize_fp8, (x.half(), s, False, True, False, 0.0)),
        (ops.quantize_fp8_weight, ([w], True, True, True, 0.0)),
        (ops.quantize_fp8_weight, (list(w.unbind(0)), False, True, False, 0.0)),
        (ops.grouped_linear_fp8, (xr.data, xr.scales, w8.data, w8.scales, s, [], None, torch.bfloat16)),
        (ops.grouped_linear_fp8, (xr.data, xr.scales, w8.data, w8.scales, s, [b], p, torch.float32, x8.routing)),
        (ops.grouped_linear_fp8_dgrad, (dyr.data, dyr.scales, w8.data_t, w8.scales_t, s, torch.float32)),
        (ops.grouped_linear_fp8_dgrad, (dyr.data, dyr.scales, w8.data_t, w8.scales_t, s, torch.bfloat16,
                                        dy8.routing)),
        (ops.grouped_linear_fp8_wgrad_, cols + ([torch.empty(3, 16, 32, dtype=torch.bfloat16)], "write")),
        (ops.grouped_linear_fp8_wgrad_, cols + ([torch.zeros(3, 16, 32)], "accumulate", dy8.routing)),
    ]


def tensors_in(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def test_opcheck_of_every_fp8_op():
    """Fake implementations against the real ops, and what each schema says it mutates.

    opcheck's test_schema compares inputs with torch.allclose, which has no float8 kernel: the ops
    that read FP8 operands are checked here instead, by their bytes before and after. The
    quantizers leave unrouted rows unwritten (whatever torch.empty gave), so AOT dispatch's
    comparison of two runs' outputs applies to the GEMMs only."""
    for op, args in op_cases():
        reads_fp8 = any(t.dtype == E4M3 for t in tensors_in(args))
        utils = ("test_faketensor", "test_autograd_registration")
        utils += ("test_aot_dispatch_dynamic",) if reads_fp8 else ("test_schema",)
        torch.library.opcheck(op, args, test_utils=utils)
        if reads_fp8:
            schema = op.default._schema.arguments
            written = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
            assert written == ({"out"} if op is ops.grouped_linear_fp8_wgrad_ else set()), op
            before = [(a.name in written, t) for a, v in zip(schema, args) for t in tensors_in([v])]
            for writes, t in before:
                if writes:
                    t.fill_(1e4)  # no value the op could leave or write there
            before = [(writes, t, t.clone()) for writes, t in before]
            op(*args)
            for writes, t, old in before:
                same = torch.equal(old.view(torch.uint8), t.view(torch.uint8))
                assert same != writes, f"{op}: {'a declared output kept its bytes' if same else 'an input changed'}"


def test_fake_implementations_give_the_real_shapes_dtypes_and_devices():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def meta(t):
        return (tuple(t.shape), t.dtype, t.device.type)

    for op, args in op_cases():
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                         [mode.from_tensor(t) for t in a] if isinstance(a, list) else a for a in args]
            fake = op(*fake_args)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert [meta(t) for t in fake if t is not None] == [meta(t) for t in real if t is not None], op
    # The fake sizes follow the C++ functions.
    for T in (0, 1, 3, 4, 5, 127, 128, 129, 1000):
        assert me.fp8_scales_pitch(T) == _C.fp8_scales_pitch(T)
        for G in (1, 2, 7, 256):
            assert me.fp8_columns_capacity(T, G) == _C.fp8_columns_capacity(T, G)


def fp8_step(x, w, dy, splits, main_grad):
    x8 = me.quantize_fp8(x, splits, rowwise=True, columnwise=True, pow2_scales=True)
    w8 = me.quantize_fp8_weight(w, pow2_scales=True)
    y = me.grouped_linear_fp8(x8, w8, splits)
    dy8 = me.quantize_fp8(dy, splits, rowwise=True, columnwise=True)
    dx = me.grouped_linear_fp8_dgrad(dy8, w8, splits, out_dtype=torch.float32)
    me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=main_grad, mode="accumulate")
    return y, dx


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_step_compiles_fullgraph(device, dynamic):
    """quantize + forward + dgrad + wgrad into main_grad trace into one graph (static and symbolic
    T), and give the eager results bit for bit."""
    needs_fp8_gemm(device)
    compiled = torch.compile(fp8_step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T, splits_list in ((200, [5, 0, 1, 37, 0, 130]), (150, [0, 100, 20, 30, 0, 0])):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, 48, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(6, 32, 48, generator=g) * 0.2).to(device, torch.bfloat16)
        dy = torch.randn(T, 32, generator=g).to(device, torch.bfloat16)
        splits = make_splits(splits_list, device)
        main_e, main_c = torch.zeros(6, 32, 48, device=device), torch.zeros(6, 32, 48, device=device)
        y_e, dx_e = fp8_step(x, w, dy, splits, main_e)
        y_c, dx_c = compiled(x, w, dy, splits, main_c)
        assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e) and torch.equal(main_c, main_e)


def test_fp8_operands_cross_a_compiled_function(device):
    """An Fp8Tensor / Fp8Weight made outside is an argument of a compiled function, and one made
    inside is its result."""
    needs_fp8_gemm(device)
    splits_list, splits, x, w, _ = problem("mixed", device)
    x8, w8 = me.quantize_fp8(x, splits), me.quantize_fp8_weight(w)
    forward = torch.compile(lambda a, b, s: me.grouped_linear_fp8(a, b, s), fullgraph=True, backend="aot_eager")
    assert torch.equal(forward(x8, w8, splits), me.grouped_linear_fp8(x8, w8, splits))
    quantize = torch.compile(lambda t, s: me.quantize_fp8(t, s, columnwise=True), fullgraph=True, backend="aot_eager")
    q = quantize(x, splits)
    rows = sum(splits_list)
    assert isinstance(q, me.Fp8Tensor) and q.num_tokens == x.shape[0]
    assert torch.equal(q.rows.data.view(torch.uint8)[:rows], x8.rows.data.view(torch.uint8)[:rows])


def test_quantizing_a_parameter_gives_operands_without_grad(device):
    needs_fp8_gemm(device)
    splits_list, splits, x, w, _ = problem("mixed", device)
    w = torch.nn.Parameter(w)
    x = x.requires_grad_()
    w8, x8 = me.quantize_fp8_weight(w), me.quantize_fp8(x, splits, columnwise=True)
    for t in (w8.data, w8.scales, w8.data_t, w8.scales_t, x8.rows.data, x8.rows.scales, x8.columns.data):
        assert not t.requires_grad
    assert not me.grouped_linear_fp8(x8, w8, splits).requires_grad


# ---- CUDA graphs ----

GRAPH_ROUTINGS = [[64, 0, 1, 191], [0, 0, 0, 256], [1, 1, 1, 1], [200, 100, 100, 112], [0, 0, 0, 0]]


def routed_parts(x8, rows):
    """The bytes and scales an FP8 operand defines (what lies past the routed tokens is unwritten)."""
    end = x8.columns.offsets[-1].item()
    return [x8.rows.data.view(torch.uint8)[:rows], x8.rows.scales[:, :rows],
            x8.columns.data.view(torch.uint8)[:, :end], x8.columns.scales[: end // 128], x8.columns.offsets]


def test_captured_fp8_step_replays_with_new_routings(cuda):
    """quantize (rows + columns of x and dy, the weight) + forward with scale_bias + dgrad + wgrad
    accumulating into main_grad, captured once and replayed with new splits: bit-identical to eager."""
    needs_fp8_gemm(cuda)
    T, K, N, G = 512, 256, 128, 4
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(G, N, K, generator=g) * K**-0.5).to(cuda, torch.bfloat16)
    b = torch.randn(G, N, generator=g).to(cuda, torch.bfloat16)
    static_x = torch.zeros(T, K, device=cuda, dtype=torch.bfloat16)
    static_dy = torch.zeros(T, N, device=cuda, dtype=torch.bfloat16)
    static_p = torch.zeros(T, device=cuda)
    static_splits = make_splits(GRAPH_ROUTINGS[0], cuda)
    main_grad = torch.zeros(G, N, K, device=cuda)

    def step(x, dy, p, splits, main):
        x8 = me.quantize_fp8(x, splits, rowwise=True, columnwise=True)
        w8 = me.quantize_fp8_weight(w)
        y = me.grouped_linear_fp8(x8, w8, splits, bias=b, row_scale=p)
        dy8 = me.quantize_fp8(dy, splits, rowwise=True, columnwise=True)
        dx = me.grouped_linear_fp8_dgrad(dy8, w8, splits, out_dtype=torch.float32)
        me.grouped_linear_fp8_wgrad(dy8, x8, splits, out=main, mode="accumulate")
        return x8, dy8, y, dx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture
        step(static_x, static_dy, static_p, static_splits, main_grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_dy, static_p, static_splits, main_grad)

    for i, routing in enumerate(GRAPH_ROUTINGS):
        gi = torch.Generator().manual_seed(i + 1)
        x = torch.randn(T, K, generator=gi).to(cuda, torch.bfloat16)
        dy = torch.randn(T, N, generator=gi).to(cuda, torch.bfloat16)
        p = torch.rand(T, generator=gi).to(cuda)
        eager_main = torch.zeros(G, N, K, device=cuda)
        x8, dy8, y, dx = step(x, dy, p, make_splits(routing, cuda), eager_main)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
            static_p.copy_(p)
            static_splits.copy_(make_splits(routing, cuda))
            main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        gx8, gdy8, gy, gdx = static_out
        rows = sum(routing)
        replayed = routed_parts(gx8, rows) + routed_parts(gdy8, rows)
        for a, e in zip(replayed, routed_parts(x8, rows) + routed_parts(dy8, rows)):
            assert torch.equal(a, e), f"routing {i}: quantized operands"
        assert torch.equal(gy, y), f"routing {i}: y"
        assert torch.equal(gdx, dx), f"routing {i}: dx"
        assert torch.equal(main_grad, eager_main), f"routing {i}: main_grad"
    me.check_errors()
