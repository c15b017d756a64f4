// The element-wise work of a Llama layer in one pass each, for CPU engines:
// RMSNorm (with the residual add before it), rotary embedding, SiLU-times-up.
//
// In eager torch each of these is a chain of operators (RMSNorm alone is
// eight), every one a pass over the activations and a dispatch; on a CPU step
// they cost about a tenth of the time. Here each is one loop over the rows.
//
// The results are Hugging Face's bit for bit, in float32 as in bf16/fp16:
// every intermediate that HF's modules round to the model dtype is rounded
// here at the same point (`round_to`), the arithmetic between roundings is
// float as in torch's CPU kernels, and where torch's order or algorithm
// decides the last bit (the norm's sum, rsqrt, exp) this code follows it
// (tests/engine_pod/model/test_cpu_layer_kernels.py checks it). One known
// exception: in float32 torch computes the last (width % 32) elements of a
// row on a scalar path with another exp, where SiLU here may differ by an
// ulp; intermediate sizes are multiples of 32 and have no such tail, and
// bf16/fp16 round it away. Hence this file is built without the other
// kernels' fast-math: no reassociation, no approximate division, no a*b+c
// contracted into one FMA (the FMAs of torch's exp are written out). Not
// trapping on float exceptions is kept: it changes no result and lets the
// loops vectorise.
#pragma GCC optimize("no-fast-math", "no-trapping-math", "fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"

namespace {

using tessera_cpu::bf16_rounded_bits;
using tessera_cpu::bits_float;
using tessera_cpu::to_bf16_bits;

// Loading, storing and rounding a model-dtype value, all through float. bf16
// is done on the bits (bf16_bits.h); the other types convert.
template <typename scalar_t>
inline float load_value(const scalar_t* p) {
  return static_cast<float>(*p);
}
template <typename scalar_t>
inline void store_value(scalar_t* p, float x) {
  *p = static_cast<scalar_t>(x);
}
template <>
inline float load_value(const c10::BFloat16* p) {
  return bits_float(static_cast<uint32_t>(p->x) << 16);
}
template <>
inline void store_value(c10::BFloat16* p, float x) {
  p->x = to_bf16_bits(x);
}

// The value as the model dtype stores it: float rounded to nearest-even in
// bf16/fp16, unchanged in float32.
template <typename scalar_t>
inline float round_to(float x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return bits_float(bf16_rounded_bits(x) & 0xFFFF0000u);
  else return static_cast<float>(static_cast<scalar_t>(x));
}

// e^x in float the way torch's vectorised CPU exp computes it (SLEEF's
// 1-ulp expf, the algorithm its AVX2/AVX-512 builds run): x = q ln2 + s with q
// rounded to even and ln2 in two parts, e^s by a degree-7 polynomial in FMAs,
// then scaled by 2^q in two halves; 0 below -104. So SiLU here
// gives torch's float, not just something within an ulp of it. A loop of these
// vectorises, where std::exp is a call per element.
inline float pow2i(int32_t q) { return bits_float(static_cast<uint32_t>(q + 127) << 23); }

inline float exp_float(float d) {
  const float q = std::nearbyint(d * 1.442695040888963407359924681001892137f);
  float s = std::fma(q, -0.693145751953125f, d);
  s = std::fma(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.f + std::fma(s * s, u, s);
  const int32_t e = static_cast<int32_t>(q);
  u = u * pow2i(e >> 1) * pow2i(e - (e >> 1));
  return d < -104.f ? 0.f : u;  // callers saturate above kExpOverflow
}

// Beyond ln(FLT_MAX) e^x is inf (and the scaling above would wrap further on).
constexpr float kExpOverflow = 88.7228391f;

// Runs f(scalar_t{}) for the tensor's dtype: float32, bfloat16 or float16 (the
// arithmetic here is float; a float64 model stays on the torch path).
template <typename F>
void dispatch_model_dtype(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 expected, got ", dtype);
  }
}

// Rows handed to one thread: enough elements that the fork is worth it.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

void check_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor expected");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, what, ": rows of ", width,
              " contiguous elements expected");
}

// The sum of a float row in the order torch's CPU sum adds it (the cascade of
// aten/src/ATen/native/cpu/SumKernel.cpp as this torch build runs it: 8-lane
// vectors dealt round-robin to 4 partial sums, each partial moved up a level
// every 16 vectors, then the partials in order, then the lanes one by one), so
// the norm's mean is torch's to the bit, not to an ulp.
float torch_order_sum(const float* v, int64_t n) {
  constexpr int64_t kLanes = 8, kPartials = 4, kLevels = 4, kLevelPower = 4;
  constexpr int64_t kStep = int64_t(1) << kLevelPower, kMask = kStep - 1;
  const int64_t num_vectors = n / kLanes, rows = num_vectors / kPartials;
  float acc[kLevels][kPartials * kLanes] = {};
  auto add_row = [&](int64_t row) {
    const float* base = v + row * kPartials * kLanes;
    for (int64_t k = 0; k < kPartials * kLanes; ++k) acc[0][k] += base[k];
  };
  int64_t i = 0;
  while (i + kStep <= rows) {
    for (int64_t j = 0; j < kStep; ++j, ++i) add_row(i);
    for (int64_t level = 1; level < kLevels; ++level) {
      for (int64_t k = 0; k < kPartials * kLanes; ++k) {
        acc[level][k] += acc[level - 1][k];
        acc[level - 1][k] = 0.f;
      }
      if ((i & (kMask << (level * kLevelPower))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t level = 1; level < kLevels; ++level)
    for (int64_t k = 0; k < kPartials * kLanes; ++k) acc[0][k] += acc[level][k];
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = acc[0][l];
  for (int64_t r = rows * kPartials; r < num_vectors; ++r)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += v[r * kLanes + l];
  for (int64_t k = 1; k < kPartials; ++k)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += acc[0][k * kLanes + l];
  float total = 0.f;
  for (int64_t k = num_vectors * kLanes; k < n; ++k) total += v[k];
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// mean(h^2) + eps as torch rounds it: a float division by n, then the float add.
inline float mean_plus_eps(float sum_of_squares, int64_t n, float eps) {
  return sum_of_squares / static_cast<float>(n) + eps;
}

// out = rms_norm(x) * weight as HF's LlamaRMSNorm computes it: h = float(x);
// h = h * rsqrt(mean(h^2) + eps); weight * dtype(h). With a residual, first
// x = residual + x (in place, rounded to the dtype as torch's add rounds),
// then the norm of that sum. Three passes: each row's mean + eps; torch's own
// rsqrt over those (its vectorised rsqrt is not 1/sqrt to the bit, and one
// call for all rows costs nothing); then the scaling.
template <typename scalar_t>
void rms_norm_kernel(const at::Tensor* residual, at::Tensor& x, const at::Tensor& weight, double eps,
                     at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const scalar_t* r_ptr = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
  at::Tensor denominators = at::empty({rows}, x.options().dtype(at::kFloat));
  float* denom = denominators.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> squares(n);
    for (int64_t row = begin; row < end; ++row) {
      scalar_t* xr = x_ptr + row * xs;
      if (r_ptr) {
        const scalar_t* rr = r_ptr + row * rs;
        for (int64_t i = 0; i < n; ++i) store_value(xr + i, load_value(rr + i) + load_value(xr + i));
      }
      for (int64_t i = 0; i < n; ++i) squares[i] = load_value(xr + i) * load_value(xr + i);
      denom[row] = mean_plus_eps(torch_order_sum(squares.data(), n), n, static_cast<float>(eps));
    }
  });
  denominators.rsqrt_();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x_ptr + row * xs;
      scalar_t* o = o_ptr + row * os;
      const float inv = denom[row];
      for (int64_t i = 0; i < n; ++i) store_value(o + i, load_value(w + i) * round_to<scalar_t>(load_value(xr + i) * inv));
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, weight.numel(), "rms_norm: x");
  check_rows(out, weight.numel(), "rms_norm: out");
  TORCH_CHECK(x.size(0) == out.size(0) && weight.is_contiguous() && x.scalar_type() == weight.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must share a dtype, out one row per row of x");
  at::Tensor input = x;
  dispatch_model_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_kernel<decltype(tag)>(nullptr, input, weight, eps, out);
  });
}

void add_rms_norm(const at::Tensor& residual, at::Tensor x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(residual, weight.numel(), "add_rms_norm: residual");
  check_rows(x, weight.numel(), "add_rms_norm: x");
  check_rows(out, weight.numel(), "add_rms_norm: out");
  TORCH_CHECK(residual.size(0) == x.size(0) && out.size(0) == x.size(0),
              "add_rms_norm: residual, x and out must have the same rows");
  TORCH_CHECK(weight.is_contiguous() && residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual, x, weight and out must share a dtype");
  dispatch_model_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    rms_norm_kernel<decltype(tag)>(&residual, x, weight, eps, out);
  });
}

// HF's apply_rotary_pos_emb, neox style: x * cos + rotate_half(x) * sin, with
// rotate_half(x) = cat(-x2, x1); each product and the sum rounded to the dtype.
template <typename scalar_t>
void rotate_heads(scalar_t* base, int64_t token_stride, int64_t head_stride, int64_t heads, int64_t dim,
                  const int64_t* positions, const scalar_t* cos, const scalar_t* sin, int64_t table_stride,
                  int64_t tokens) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos + positions[t] * table_stride;
      const scalar_t* s = sin + positions[t] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = base + t * token_stride + h * head_stride;
        for (int64_t d = 0; d < dim; ++d) x[d] = load_value(row + d);
        for (int64_t d = 0; d < half; ++d) {
          const float a = round_to<scalar_t>(x[d] * load_value(c + d));
          const float b = round_to<scalar_t>(-x[d + half] * load_value(s + d));
          store_value(row + d, a + b);
        }
        for (int64_t d = half; d < dim; ++d) {
          const float a = round_to<scalar_t>(x[d] * load_value(c + d));
          const float b = round_to<scalar_t>(x[d - half] * load_value(s + d));
          store_value(row + d, a + b);
        }
      }
    }
  });
}

void check_heads(const at::Tensor& t, int64_t tokens, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == tokens && t.size(2) == dim && t.stride(2) == 1,
              what, ": [tokens, heads, head_dim] with a contiguous head dimension expected");
}

// Rotates q [T, Hq, D] and k [T, Hkv, D] in place by the table rows of positions [T].
void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  const int64_t tokens = positions.numel(), dim = cos.size(-1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "rotary_embedding: positions must be a contiguous int64 vector");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  dim % 2 == 0,
              "rotary_embedding: cos and sin must be contiguous [max_len, head_dim] tables of an even head size");
  check_heads(query, tokens, dim, "rotary_embedding: query");
  check_heads(key, tokens, dim, "rotary_embedding: key");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "rotary_embedding: query, key and the tables must share a dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_len = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_len, "rotary_embedding: position ", pos[t], " outside the table");
  dispatch_model_dtype(query.scalar_type(), "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    rotate_heads(query.data_ptr<scalar_t>(), query.stride(0), query.stride(1), query.size(1), dim, pos, c, s,
                 cos.stride(0), tokens);
    rotate_heads(key.data_ptr<scalar_t>(), key.stride(0), key.stride(1), key.size(1), dim, pos, c, s,
                 cos.stride(0), tokens);
  });
}

// HF's LlamaMLP activation: silu(gate) * up over x = [gate | up] rows; silu
// rounded to the dtype before the product, as torch's two operators round.
template <typename scalar_t>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(-1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = x_ptr + row * xs;
      const scalar_t* up = gate + n;
      scalar_t* o = o_ptr + row * os;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = load_value(gate + i);
        // Where exp(-g) overflows (to inf in torch) torch's silu is g / inf = -0.
        const float act = round_to<scalar_t>(-g > kExpOverflow ? -0.f : g / (1.f + exp_float(-g)));
        store_value(o + i, act * load_value(up + i));
      }
    }
  });
}

void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  check_rows(out, out.size(-1), "silu_and_mul: out");
  check_rows(x, 2 * out.size(-1), "silu_and_mul: x");
  TORCH_CHECK(out.size(0) == x.size(0) && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be [rows, half of x's width] in x's dtype");
  dispatch_model_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) { silu_and_mul_kernel<decltype(tag)>(x, out); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor residual, Tensor(a!) x, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
