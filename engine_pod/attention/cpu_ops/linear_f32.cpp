// float32 projections (y = x W^T + b) for CPU engines on AVX2 machines without AVX-512.
//
// There oneDNN's packed GEMM, the engine's choice elsewhere, runs the few-row
// products of decode steps at half the core's FMA rate or less (the bench
// model's projections at 16 rows: 70 GFLOP/s on two cores, where streaming
// the weights once would allow 150), and no better than this kernel at
// thousands of rows (`tessera bench cpu-kernels`). This is the classic
// register-blocked GEMM: the weight is packed once into panels of 16 output
// features, [panel][k][16], so a panel's row for one k is two vector loads;
// the input is packed per call into blocks of 6 rows, [block][k][6], so its
// 6 values for one k are 6 broadcasts; each 6 x 16 tile of the output then
// lives in 12 of the 16 vector registers while k runs (12 FMAs per k against
// 8 loads). k goes in slices of kSliceK so a panel's slice stays in L1 while
// every row block of a pass multiplies it, and rows in passes of kPassRows
// so their packed slice stays in L2. Threads split the panels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TESSERA_LINEAR_F32 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output features per weight panel (two AVX2 vectors)
constexpr int64_t kBlockRows = 6;  // input rows per register tile
constexpr int64_t kSliceK = 256;   // k per pass over a panel: 16 KiB of it, in L1
constexpr int64_t kPassRows = 120;  // rows per pass over all panels (20 tiles)

bool linear_f32_supported() {
#if defined(TESSERA_LINEAR_F32)
  return true;
#else
  return false;
#endif
}

// [N, K] -> [ceil(N / 16), K, 16], the features past N zero.
at::Tensor pack_linear_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_f32: a 2-d float32 CPU weight [out_features, in_features] expected");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).permute({0, 2, 1}).contiguous();
}

#if defined(TESSERA_LINEAR_F32)
// out[r][0..15] (+)= sum over k < kc of a[k][r] * p[k][0..15], r < R: a is a packed row
// block's slice, p a panel's; `accumulate` adds to what out holds (a later slice of k).
template <int R>
void tile(const float* a, const float* p, int64_t kc, float* out, int64_t ld_out, bool accumulate) {
  // Named accumulators: with an array GCC keeps a copy of it on the stack, a store per FMA.
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0,
         l5 = l0, h5 = l0;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 p0 = _mm256_loadu_ps(p + k * kPanel), p1 = _mm256_loadu_ps(p + k * kPanel + 8);
    const float* ak = a + k * kBlockRows;
#define TESSERA_TILE_ROW(r, lo, hi)                   \
  if constexpr (R > r) {                              \
    const __m256 x = _mm256_broadcast_ss(ak + r);     \
    lo = _mm256_fmadd_ps(x, p0, lo);                  \
    hi = _mm256_fmadd_ps(x, p1, hi);                  \
  }
    TESSERA_TILE_ROW(0, l0, h0)
    TESSERA_TILE_ROW(1, l1, h1)
    TESSERA_TILE_ROW(2, l2, h2)
    TESSERA_TILE_ROW(3, l3, h3)
    TESSERA_TILE_ROW(4, l4, h4)
    TESSERA_TILE_ROW(5, l5, h5)
#undef TESSERA_TILE_ROW
  }
  const __m256 lo[kBlockRows] = {l0, l1, l2, l3, l4, l5}, hi[kBlockRows] = {h0, h1, h2, h3, h4, h5};
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ld_out;
    _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(lo[r], _mm256_loadu_ps(o)) : lo[r]);
    _mm256_storeu_ps(o + 8, accumulate ? _mm256_add_ps(hi[r], _mm256_loadu_ps(o + 8)) : hi[r]);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, bool);
constexpr TileFn kTiles[kBlockRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// [M, K] -> [ceil(M / 6)][K][6], the rows past M zero.
void pack_rows(const float* x, int64_t m, int64_t k, float* packed) {
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* dst = packed + b * k * kBlockRows;
      const int64_t rows = std::min(kBlockRows, m - b * kBlockRows);
      if (rows < kBlockRows) std::memset(dst, 0, k * kBlockRows * sizeof(float));
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (b * kBlockRows + r) * k;
        for (int64_t i = 0; i < k; ++i) dst[i * kBlockRows + r] = src[i];
      }
    }
  });
}

// out [M, panels * 16] = x [M, K] times the packed weight.
void gemm(const float* x, int64_t m, int64_t k, const float* packed, int64_t panels, float* out) {
  const int64_t ld_out = panels * kPanel, blocks = (m + kBlockRows - 1) / kBlockRows;
  std::unique_ptr<float[]> rows(new float[blocks * k * kBlockRows]);
  pack_rows(x, m, k, rows.get());
  constexpr int64_t kPassBlocks = kPassRows / kBlockRows;
  for (int64_t first = 0; first < blocks; first += kPassBlocks) {
    const int64_t last = std::min(blocks, first + kPassBlocks);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const float* panel = packed + j * k * kPanel;
        for (int64_t k0 = 0; k0 < k; k0 += kSliceK) {
          const int64_t kc = std::min(kSliceK, k - k0);
          for (int64_t b = first; b < last; ++b) {
            const int64_t r = std::min(kBlockRows, m - b * kBlockRows);
            kTiles[r](rows.get() + b * k * kBlockRows + k0 * kBlockRows, panel + k0 * kPanel, kc,
                      out + b * kBlockRows * ld_out + j * kPanel, ld_out, k0 > 0);
          }
        }
      }
    });
  }
}
#endif

// x [..., K] times a weight packed by pack_linear_f32 (out_features of its rows real), plus bias.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const c10::optional<at::Tensor>& bias) {
  const char* op = "linear_f32";
  TORCH_CHECK(linear_f32_supported(), op, ": built for AVX2 with FMA and without AVX-512 only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && x.device().is_cpu() &&
              packed.device().is_cpu(), op, ": float32 CPU tensors expected");
  TORCH_CHECK(x.dim() >= 1 && packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), op,
              ": x [..., in_features] and a weight packed by pack_linear_f32 expected");
  const int64_t k = x.size(-1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, op, ": x has ", k, " features, the weight ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel, op,
              ": out_features ", out_features, " does not match the packed weight's ", panels, " panels");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat, op,
                ": bias must be a float32 vector of out_features");
  const at::Tensor rows = (x.dim() == 1 ? x.unsqueeze(0) : x.flatten(0, -2)).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor out = at::empty({m, panels * kPanel}, x.options());
#if defined(TESSERA_LINEAR_F32)
  if (m > 0 && k > 0) gemm(rows.data_ptr<float>(), m, k, packed.data_ptr<float>(), panels, out.data_ptr<float>());
  else out.zero_();
#endif
  if (out_features != panels * kPanel) out = out.narrow(1, 0, out_features).contiguous();
  if (bias.has_value()) out.add_(*bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("linear_f32_supported() -> bool");
  m.def("pack_linear_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &linear_f32);
}

TORCH_LIBRARY_IMPL(tessera_cpu, CompositeExplicitAutograd, m) {
  m.impl("linear_f32_supported", &linear_f32_supported);
}
