// Fused CPU kernel for base._blocked_attention: exact causal attention of a query chunk, the column mass each
// key receives (summed over queries and the query heads of its KV group) and, optionally, each query's Shannon
// entropy, computed per (KV head, block of queries) with the block's logits kept in one core's cache.
//
// Loaded by luka_bench/methods/cpu_kernel.py (torch.utils.cpp_extension, compiled on first use); the pure-torch
// loop in base._blocked_attention computes the same quantities and is the reference the tests compare with.
//
// Also lychee_decode: LycheeCluster's coarse-to-fine choice for one decode query on the CPU (its scores, units
// kept in rank order, the kept units' chunks ordered by their cluster's UB and their own score, the prefix that
// fits the budget, its tokens as rows of the flattened storage) in one call, where the same rule as torch ops
// (lychee.LycheePolicy._decode_attend, the path CUDA runs and the tests' reference) costs ~20 small ops whose
// dispatch dominates a step here. And rows_attention: a decode query's exact attention over rows of the storage
// chosen per head, read in place (no gathered copy). And lychee_index_add / lychee_table: its lazy index update at a
// chunk closing (lychee_pool: the new chunks' keys) and the decode table rebuilt from the index, each one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// exp(x) for x <= 0 (0 below -87.3, where float underflows): Cephes' polynomial, 8 lanes at a time with AVX2.
inline float exp_nonpos(float x) {
  const float lo = -87.3f;
  if (x < lo) return 0.f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return std::ldexp(p, static_cast<int>(n));
}
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

void row_max(const float* __restrict row, float* __restrict m, int64_t R) {
#pragma omp simd
  for (int64_t r = 0; r < R; ++r) m[r] = row[r] > m[r] ? row[r] : m[r];
}

void row_exp(float* __restrict row, const float* __restrict m, float* __restrict l, int64_t R) {
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; r + 8 <= R; r += 8) {
    const __m256 p = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(row + r), _mm256_loadu_ps(m + r)));
    _mm256_storeu_ps(row + r, p);
    _mm256_storeu_ps(l + r, _mm256_add_ps(_mm256_loadu_ps(l + r), p));
  }
#endif
  for (; r < R; ++r) { const float p = exp_nonpos(row[r] - m[r]); row[r] = p; l[r] += p; }
}

float row_dot(const float* __restrict row, const float* __restrict w, int64_t R) {
  float acc = 0.f;
#pragma omp simd reduction(+:acc)
  for (int64_t r = 0; r < R; ++r) acc += row[r] * w[r];
  return acc;
}

// qs [H, g, L, D] (queries already multiplied by the softmax scale), k [H, n, D], v [H, n, Dv], fp32; query i
// of the chunk sits at position past + i and sees keys 0 .. past + i. Returns (out [H, g, L, Dv], mass [H, n],
// entropy [H, g, L] in nats, empty unless `entropy`). Work is split across the intra-op threads by (KV head,
// query block), largest blocks first, each thread with its own logits buffer and mass accumulator.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_mass(const at::Tensor& qs_in, const at::Tensor& k_in,
                                                              const at::Tensor& v_in, int64_t past, int64_t block,
                                                              bool entropy) {
  TORCH_CHECK(qs_in.device().is_cpu() && qs_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat &&
                  v_in.scalar_type() == at::kFloat,
              "attention_mass: CPU float32 tensors only");
  TORCH_CHECK(qs_in.dim() == 4 && k_in.dim() == 3 && v_in.dim() == 3, "attention_mass: qs [H,g,L,D], k/v [H,n,D]");
  const at::Tensor qs = qs_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t H = qs.size(0), g = qs.size(1), L = qs.size(2), d = qs.size(3);
  const int64_t n = k.size(1), dv = v.size(2);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && k.size(2) == d && v.size(1) == n && n == past + L && block > 0,
              "attention_mass: shapes do not match");
  auto out = at::empty({H, g, L, dv}, qs.options());
  auto ent = entropy ? at::empty({H, g, L}, qs.options()) : at::empty({0}, qs.options());
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  auto mass = at::zeros({nt, H, n}, qs.options());
  const int64_t nb = (L + block - 1) / block, ntasks = H * nb;
  const float* qp = qs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* ep = entropy ? ent.data_ptr<float>() : nullptr;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tid = t0; tid < t1; ++tid) {
      const int64_t Rmax = g * block;
      auto S = at::empty({n * Rmax}, qs.options());  // logits, then exp'd weights: keys-major [e, R]
      auto Qb = at::empty({Rmax, d}, qs.options());
      auto O = at::empty({Rmax, dv}, qs.options());
      auto Kb = entropy ? at::empty({Rmax, d}, qs.options()) : at::Tensor();
      std::vector<float> mx(Rmax), lsum(Rmax), inv(Rmax);
      float* M = mass[tid].data_ptr<float>();
      for (int64_t task = tid; task < ntasks; task += nt) {
        const int64_t h = task % H, bi = nb - 1 - task / H;
        const int64_t s = bi * block, c = std::min(block, L - s), e = past + s + c, R = g * c;
        float* qb = Qb.data_ptr<float>();  // row gi * c + i: query s + i of group head gi
        for (int64_t gi = 0; gi < g; ++gi)
          std::memcpy(qb + gi * c * d, qp + ((h * g + gi) * L + s) * d, sizeof(float) * c * d);
        auto Sv = S.narrow(0, 0, e * R).view({e, R});
        at::mm_out(Sv, k[h].narrow(0, 0, e), Qb.narrow(0, 0, R).t());
        float* sp = Sv.data_ptr<float>();
        const float NEG = -std::numeric_limits<float>::infinity();
        for (int64_t jj = 1; jj < c; ++jj) {  // key past + s + jj comes after queries s .. s + jj - 1
          float* row = sp + (e - c + jj) * R;
          for (int64_t gi = 0; gi < g; ++gi)
            for (int64_t i = 0; i < jj; ++i) row[gi * c + i] = NEG;
        }
        float* m = mx.data();
        float* l = lsum.data();
        float* iv = inv.data();
        for (int64_t r = 0; r < R; ++r) { m[r] = NEG; l[r] = 0.f; }
        for (int64_t j = 0; j < e; ++j) row_max(sp + j * R, m, R);
        for (int64_t j = 0; j < e; ++j) row_exp(sp + j * R, m, l, R);
        for (int64_t r = 0; r < R; ++r) iv[r] = 1.f / l[r];
        auto Ov = O.narrow(0, 0, R);
        at::mm_out(Ov, Sv.t(), v[h].narrow(0, 0, e));
        const float* o = Ov.data_ptr<float>();
        for (int64_t r = 0; r < R; ++r) {  // row r: group head r / c, query s + r % c
          const float* src = o + r * dv;
          float* dst = op + ((h * g + r / c) * L + s + r % c) * dv;
          for (int64_t x = 0; x < dv; ++x) dst[x] = src[x] * iv[r];
        }
        float* mh = M + h * n;
        for (int64_t j = 0; j < e; ++j) mh[j] += row_dot(sp + j * R, iv, R);
        if (entropy) {  // H = max + log l - q . (sum_j p_j k_j)
          auto Kv = Kb.narrow(0, 0, R);
          at::mm_out(Kv, Sv.t(), k[h].narrow(0, 0, e));
          const float* kb = Kv.data_ptr<float>();
          for (int64_t r = 0; r < R; ++r) {
            double qk = 0.0;  // in double: H is a small difference of large terms when attention is peaked
            for (int64_t x = 0; x < d; ++x) qk += static_cast<double>(qb[r * d + x]) * kb[r * d + x];
            const double h_r = m[r] + std::log(static_cast<double>(l[r])) - qk / l[r];
            ep[(h * g + r / c) * L + s + r % c] = static_cast<float>(h_r);
          }
        }
      }
    }
  });
  return {out, mass.sum(0), ent};
}

// y += w * x over n floats (vectorised: the pointers do not alias)
void axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// One decode query's LycheeCluster choice (lychee.LycheePolicy._decode_attend on the CPU). q [B, H, g, D] fp32:
// the query heads of each KV head; tab [B, H, D + g + 1, P + L + M] fp32: each unit's, fine cluster's and chunk's
// column [centroid or key, its radius g times, 0 or -inf]; the scores are [sum of q, |q_1| .. |q_g| (ub) or 0, 1]
// @ tab.
// chunk_unit [B, H, M] (unit of each chunk), chunk_cluster [B, H, M] (its cluster's score index), tok_g [B, H, P]
// (tokens per unit), slen [M] (chunk lengths), start_rows [B, H, M] and rows [B, H, cap] (storage rows of each
// chunk's first token and of each slot, flattened storage). Units: by score, descending (ties: lower index
// first), the live ones (score > -inf) kept while the tokens kept so far are under unit_limit (k_g > 0: the
// first k_g). Chunks of kept units: by (cluster UB desc, cluster index, own score desc, chunk index), read while
// their tokens fit R. R, unit_limit, fr and n are per batch row (one value: every row's; stacked rows of a batch,
// stacked.py, each with its own budget, frontier and length; slen [B, M] then gives each row's chunk lengths).
// Returns idx [B, H, S + C + W] with W the largest n - fr (rows of the sinks, of the read tokens then padding =
// the first chunk's first row, of the recent tokens fr..n-1, then the row's first slot), pad [B, H, C] (bool),
// order [B, H, cmax] (chunks read, in order; 0 after), lens [B, H, cmax] (their lengths; 0 after), sel [B, H, P]
// (units kept). If bias [B, H, 1, >= S + C + W] (fp32) is given, its slots S..S+C+W get 0 / -inf for read /
// padding (a row's recent slots from its n - fr on: padding).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lychee_decode(
    const at::Tensor& q_in, const at::Tensor& tab_in, const at::Tensor& unit_in, const at::Tensor& cluster_in,
    const at::Tensor& tok_in, const at::Tensor& slen_in, const at::Tensor& start_in, const at::Tensor& rows_in,
    const at::Tensor& bias, int64_t P, int64_t L, bool ub, at::ArrayRef<double> limits, int64_t k_g,
    at::IntArrayRef Rs, int64_t cmax, int64_t C, int64_t S, at::IntArrayRef frs, at::IntArrayRef ns) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && tab_in.scalar_type() == at::kFloat &&
              tok_in.scalar_type() == at::kFloat, "lychee_decode: fp32 query, table and token counts");
  const at::Tensor q = q_in.contiguous(), tab = tab_in.contiguous(), unit = unit_in.contiguous();
  const at::Tensor cluster = cluster_in.contiguous(), tok = tok_in.contiguous(), slen = slen_in.contiguous();
  const at::Tensor start = start_in.contiguous(), rows = rows_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t N = tab.size(3), M = unit.size(2), cap = rows.size(2);
  const int64_t E = D + G + 1;  // table rows: the key part, one radius row per query head of the group, the -inf row
  TORCH_CHECK(tab.size(2) == E && N == P + L + M, "lychee_decode: a [D + G + 1, P + L + M] table per head");
  auto per_row = [B](auto list, const char* what) {
    TORCH_CHECK(list.size() == 1 || (int64_t)list.size() == B, "lychee_decode: one ", what, " or one per row");
    return [list](int64_t b) { return list[list.size() == 1 ? 0 : b]; };
  };
  const auto R_of = per_row(Rs, "R"), fr_of = per_row(frs, "frontier"), n_of = per_row(ns, "length");
  const auto limit_of = per_row(limits, "unit_limit");
  int64_t W = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(n_of(b) <= cap && S <= fr_of(b) && fr_of(b) <= n_of(b), "lychee_decode: slots out of the storage");
    W = std::max(W, n_of(b) - fr_of(b));
  }
  const int64_t T = S + C + W;
  const int64_t ls = slen.dim() == 2 ? slen.size(1) : 0;  // per-row chunk lengths (stacked rows) or the prompt's
  const bool write_bias = bias.defined() && bias.numel() > 0;
  if (write_bias)
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.stride(3) == 1 && bias.size(3) >= T,
                "lychee_decode: an fp32 bias with unit stride");
  auto lopt = q.options().dtype(at::kLong);
  at::Tensor idx = at::empty({B, H, T}, lopt), order = at::zeros({B, H, cmax}, lopt);
  at::Tensor lens = at::zeros({B, H, cmax}, lopt);
  at::Tensor pad = at::empty({B, H, C}, q.options().dtype(at::kBool));
  at::Tensor sel = at::zeros({B, H, P}, q.options().dtype(at::kBool));
  const float *Q = q.data_ptr<float>(), *Tb = tab.data_ptr<float>(), *Tk = tok.data_ptr<float>();
  const int64_t *U = unit.data_ptr<int64_t>(), *Cl = cluster.data_ptr<int64_t>(), *Ln = slen.data_ptr<int64_t>();
  const int64_t *St = start.data_ptr<int64_t>(), *Rw = rows.data_ptr<int64_t>();
  int64_t *I = idx.data_ptr<int64_t>(), *O = order.data_ptr<int64_t>(), *Le = lens.data_ptr<int64_t>();
  bool *Pd = pad.data_ptr<bool>(), *Se = sel.data_ptr<bool>();
  float* Bi = write_bias ? bias.data_ptr<float>() : nullptr;
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {  // each (row, KV head) alone: split over threads
    std::vector<float> qa(E), sc(N);
    std::vector<int64_t> units(P), cand;
    cand.reserve(M);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t R = R_of(b), fr = fr_of(b), n = n_of(b);
      const double unit_limit = limit_of(b);
      const int64_t* ln = Ln + b * ls;
      // the group's summed query, each query head's norm, 1
      std::fill(qa.begin(), qa.end(), 0.0f);
      for (int64_t i = 0; i < G; ++i) {
        const float* qi = Q + (bh * G + i) * D;
        float nn = 0.0f;
        for (int64_t e = 0; e < D; ++e) {
          qa[e] += qi[e];
          nn += qi[e] * qi[e];
        }
        if (ub) qa[D + i] = std::sqrt(nn);
      }
      qa[E - 1] = 1.0f;
      // every node's score: a row vector times the table (contiguous over the nodes)
      const float* tb = Tb + bh * E * N;
      std::fill(sc.begin(), sc.end(), 0.0f);
      for (int64_t e = 0; e < E; ++e) {
        const float w = qa[e];
        if (w == 0.0f && e != E - 1) continue;  // (the -inf row always counts: its weight is 1)
        axpy(w, tb + e * N, sc.data(), N);
      }
      const float* s = sc.data();
      const int64_t *u = U + bh * M, *cl = Cl + bh * M, *st = St + bh * M, *rw = Rw + bh * cap;
      bool* se = Se + bh * P;
      for (int64_t i = 0; i < P; ++i) units[i] = i;
      std::stable_sort(units.begin(), units.end(), [&](int64_t a, int64_t c) { return s[a] > s[c]; });
      double held = 0.0;
      int64_t kept = 0;
      for (int64_t r = 0; r < P; ++r) {
        const int64_t g = units[r];
        if (!(s[g] > ninf)) break;  // the dead units sort last
        if (k_g > 0) {
          if (kept >= k_g) break;
        } else if (!(held < unit_limit)) {
          break;
        }
        se[g] = true;
        held += Tk[bh * P + g];
        ++kept;
      }
      cand.clear();
      for (int64_t j = 0; j < M; ++j)
        if (se[u[j]]) cand.push_back(j);
      const float* own = s + P + L;
      std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t c) {
        const float pa = s[cl[a]], pc = s[cl[c]];
        if (pa != pc) return pa > pc;
        if (cl[a] != cl[c]) return cl[a] < cl[c];
        if (own[a] != own[c]) return own[a] > own[c];
        return a < c;
      });
      int64_t* out = I + bh * T;
      for (int64_t x = 0; x < S; ++x) out[x] = rw[x];
      for (int64_t x = fr; x < n; ++x) out[S + C + (x - fr)] = rw[x];
      for (int64_t x = n - fr; x < W; ++x) out[S + C + x] = rw[0];  // a shorter row's free recent slots (masked)
      int64_t used = 0, pos = 0, k = 0;
      for (int64_t j : cand) {
        const int64_t len = ln[j];
        if (used + len > R || k >= cmax || pos + len > C) break;
        for (int64_t w = 0; w < len; ++w) out[S + pos + w] = st[j] + w;
        O[bh * cmax + k] = j;
        Le[bh * cmax + k] = len;
        used += len;
        pos += len;
        ++k;
      }
      const int64_t fill = M ? st[0] : rw[0];
      for (int64_t x = pos; x < C; ++x) out[S + x] = fill;
      for (int64_t x = 0; x < C; ++x) Pd[bh * C + x] = x >= pos;
      if (write_bias) {
        float* bi = Bi + b * bias.stride(0) + h * bias.stride(1) + S;
        for (int64_t x = 0; x < C; ++x) bi[x] = x < pos ? 0.0f : ninf;
        for (int64_t x = 0; x < W; ++x) bi[C + x] = x < n - fr ? 0.0f : ninf;
      }
    }
  });
  return {idx, pad, order, lens, sel};
}


// Exact attention of one decode query per query head over storage rows chosen per (batch row, KV head), read where
// they lie: q [B, H, G, D] fp32 (the G query heads of each KV head), kv [2, N, D] fp32 (the flattened storage's key
// rows, then its value rows; unit stride over D), idx [B, H, T] int64 (the rows read), bias [B, H, 1, >= T] fp32
// (added to the scaled logits; -inf: the row is not read). Returns out [B, H, G, D] = softmax(q . k * scale + bias)
// @ v: SDPA over the gathered rows without the gather's copy (lychee's decode step reads ~1,000 rows per head: the
// copy cost as much as the attention). Each (batch row, KV head) is computed alone, in the same order whatever the
// batch: a row stacked with others gets the bits it gets alone.
constexpr int64_t AHEAD = 6;  // rows_attention: rows read ahead of the one in use (their addresses are random)

inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t e = 0; e < D; e += 16) __builtin_prefetch(row + e);
}

// dots[g] = q_g . k for the G query heads of a group (q [G, D]): the key row loaded once for all of them.
inline void group_dots(const float* __restrict q, const float* __restrict k, int64_t G, int64_t D,
                       std::vector<float>& dots) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && G <= 8) {
    __m256 a[8];
    for (int64_t g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t e = 0; e < D; e += 8) {
      const __m256 kk = _mm256_loadu_ps(k + e);
      for (int64_t g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + e), kk, a[g]);
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[g]), _mm256_extractf128_ps(a[g], 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      dots[g] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) dots[g] = row_dot(q + g * D, k, D);
}

#if defined(__AVX2__) && defined(__FMA__)
// The sums of four 8-lane vectors: [sum a0, sum a1, sum a2, sum a3].
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// out[gi * 4 + j] = q_(g0 + gi) . k_j for NG query heads and four key rows (D % 8 == 0): each key vector loaded once
// for the NG heads, the horizontal sums done four keys at a time.
template <int NG>
inline void dots_4keys(const float* __restrict q, const float* const* k, int64_t D, float* out) {
  __m256 a[NG][4];
  for (int gi = 0; gi < NG; ++gi)
    for (int j = 0; j < 4; ++j) a[gi][j] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; e += 8) {
    const __m256 k0 = _mm256_loadu_ps(k[0] + e), k1 = _mm256_loadu_ps(k[1] + e), k2 = _mm256_loadu_ps(k[2] + e),
                 k3 = _mm256_loadu_ps(k[3] + e);
    for (int gi = 0; gi < NG; ++gi) {
      const __m256 qq = _mm256_loadu_ps(q + gi * D + e);
      a[gi][0] = _mm256_fmadd_ps(qq, k0, a[gi][0]);
      a[gi][1] = _mm256_fmadd_ps(qq, k1, a[gi][1]);
      a[gi][2] = _mm256_fmadd_ps(qq, k2, a[gi][2]);
      a[gi][3] = _mm256_fmadd_ps(qq, k3, a[gi][3]);
    }
  }
  for (int gi = 0; gi < NG; ++gi) _mm_storeu_ps(out + gi * 4, hsum4(a[gi][0], a[gi][1], a[gi][2], a[gi][3]));
}

// acc[gi * D + d0 .. + 32] += sum_t p[gi][t] * v_t[d0 .. + 32] over the rows of one block (NG query heads, 32
// value columns: the accumulators stay in registers over the block).
template <int NG>
inline void values_block(const float* const* v, const float* p, int64_t T, int64_t n, int64_t d0, int64_t D,
                         float* acc) {
  __m256 a[NG][4];
  for (int gi = 0; gi < NG; ++gi)
    for (int i = 0; i < 4; ++i) a[gi][i] = _mm256_loadu_ps(acc + gi * D + d0 + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    if (v[t] == nullptr) continue;
    const float* r = v[t] + d0;
    const __m256 v0 = _mm256_loadu_ps(r), v1 = _mm256_loadu_ps(r + 8), v2 = _mm256_loadu_ps(r + 16),
                 v3 = _mm256_loadu_ps(r + 24);
    for (int gi = 0; gi < NG; ++gi) {
      const __m256 w = _mm256_broadcast_ss(p + gi * T + t);
      a[gi][0] = _mm256_fmadd_ps(w, v0, a[gi][0]);
      a[gi][1] = _mm256_fmadd_ps(w, v1, a[gi][1]);
      a[gi][2] = _mm256_fmadd_ps(w, v2, a[gi][2]);
      a[gi][3] = _mm256_fmadd_ps(w, v3, a[gi][3]);
    }
  }
  for (int gi = 0; gi < NG; ++gi)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + gi * D + d0 + 8 * i, a[gi][i]);
}
#endif

// One (batch row, KV head)'s attention for rows_attention and segments_attention: the G query heads qb [G, D] over
// the T key / value rows row(t) (row indices into K / V, rs floats apart) with the additive bias bi[t] (-inf: the row
// is not read); o [G, D]. lg / acc / mx / inv / dots: the caller's scratch (G * T, G * D, G, G, 4 * G floats). With
// AVX2 and D % 32 == 0 the logits are taken four keys at a time and the weighted values in blocks of 16 rows whose
// values stay in the core's cache while 32 columns of two heads' sums stay in registers; the same sums otherwise,
// one key at a time.
constexpr int64_t VBLOCK = 16;
template <typename Row>
void head_attention(const float* qb, const float* K, const float* V, int64_t rs, Row row, const float* bi,
                    int64_t T, int64_t G, int64_t D, float sc, float* o, std::vector<float>& lg,
                    std::vector<float>& acc, std::vector<float>& mx, std::vector<float>& inv,
                    std::vector<float>& dots) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(mx.begin(), mx.end(), ninf);
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const bool wide = D % 32 == 0;
  if (wide) {  // the logits four keys at a time (a masked key's logit computed, then -inf)
    for (; t + 4 <= T; t += 4) {
      const float* k[4];
      for (int j = 0; j < 4; ++j) {
        k[j] = K + row(t + j) * rs;
        if (t + j + AHEAD < T) prefetch_row(K + row(t + j + AHEAD) * rs, D);
      }
      for (int64_t g0 = 0; g0 < G; g0 += 2) {
        if (G - g0 >= 2) dots_4keys<2>(qb + g0 * D, k, D, dots.data() + g0 * 4);
        else dots_4keys<1>(qb + g0 * D, k, D, dots.data() + g0 * 4);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) {
          const float s = bi[t + j] > ninf ? dots[g * 4 + j] * sc + bi[t + j] : ninf;
          lg[g * T + t + j] = s;
          mx[g] = s > mx[g] ? s : mx[g];
        }
    }
  }
#endif
  for (; t < T; ++t) {  // the logits: each key row read once for the group's query heads
    if (!(bi[t] > ninf)) {
      for (int64_t g = 0; g < G; ++g) lg[g * T + t] = ninf;
      continue;
    }
    if (t + AHEAD < T) prefetch_row(K + row(t + AHEAD) * rs, D);
    group_dots(qb, K + row(t) * rs, G, D, dots);
    for (int64_t g = 0; g < G; ++g) {
      const float s = dots[g] * sc + bi[t];
      lg[g * T + t] = s;
      mx[g] = s > mx[g] ? s : mx[g];
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // exp(logit - max) in place, and its sum
    float* r = lg.data() + g * T;
    float l = 0.f;
    int64_t x = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 m8 = _mm256_set1_ps(mx[g]);
    __m256 l8 = _mm256_setzero_ps();
    for (; x + 8 <= T; x += 8) {
      const __m256 p = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(r + x), m8));
      _mm256_storeu_ps(r + x, p);
      l8 = _mm256_add_ps(l8, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, l8);
    for (int e = 0; e < 8; ++e) l += lanes[e];
#endif
    for (; x < T; ++x) { r[x] = exp_nonpos(r[x] - mx[g]); l += r[x]; }
    inv[g] = 1.f / l;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX2__) && defined(__FMA__)
  if (wide) {  // the weighted values: a block of rows, read once from memory, then every head pair and column run
    const float* vb[VBLOCK];
    for (int64_t t0 = 0; t0 < T; t0 += VBLOCK) {
      const int64_t n = std::min(VBLOCK, T - t0);
      for (int64_t j = 0; j < n; ++j) {
        vb[j] = bi[t0 + j] > ninf ? V + row(t0 + j) * rs : nullptr;
        if (t0 + j + VBLOCK < T && bi[t0 + j + VBLOCK] > ninf) prefetch_row(V + row(t0 + j + VBLOCK) * rs, D);
      }
      for (int64_t g0 = 0; g0 < G; g0 += 2)
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
          if (G - g0 >= 2) values_block<2>(vb, lg.data() + g0 * T + t0, T, n, d0, D, acc.data() + g0 * D);
          else values_block<1>(vb, lg.data() + g0 * T + t0, T, n, d0, D, acc.data() + g0 * D);
        }
    }
  } else
#endif
  {
    for (int64_t x = 0; x < T; ++x) {  // the weighted values: each value row read once
      if (!(bi[x] > ninf)) continue;
      if (x + AHEAD < T) prefetch_row(V + row(x + AHEAD) * rs, D);
      const float* v = V + row(x) * rs;
      for (int64_t g = 0; g < G; ++g) {
        const float p = lg[g * T + x];
        if (p != 0.f) axpy(p, v, acc.data() + g * D, D);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < D; ++e) o[g * D + e] = acc[g * D + e] * inv[g];
}

// The (batch row, KV head) driver of rows_attention and segments_attention: q [B, H, G, D] and kv [2, N, D] checked
// by the caller, T the longest run read; item(bh) gives that head's (row function, bias pointer, length). Returns
// out [B, H, G, D], one work item per (batch row, KV head).
template <typename Item>
at::Tensor heads_attention(const at::Tensor& q, const at::Tensor& kv, int64_t T, double scale, Item item) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, G, D}, q.options());
  const float* Q = q.data_ptr<float>();
  const float* K = kv.data_ptr<float>();
  const float* V = K + kv.stride(0);
  const int64_t rs = kv.stride(1);
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t a, int64_t z) {
    std::vector<float> lg(G * T), acc(G * D), mx(G), inv(G), dots(4 * G);
    for (int64_t bh = a; bh < z; ++bh) {
      const auto [row, bi, len] = item(bh);
      head_attention(Q + bh * G * D, K, V, rs, row, bi, len, G, D, sc, O + bh * G * D, lg, acc, mx, inv, dots);
    }
  });
  return out;
}

at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& idx_in,
                          const at::Tensor& bias, double scale) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat && idx_in.scalar_type() == at::kLong,
              "rows_attention: fp32 query, storage and bias, int64 rows");
  TORCH_CHECK(q_in.dim() == 4 && kv.dim() == 3 && kv.size(0) == 2 && kv.stride(2) == 1 && idx_in.dim() == 3 &&
                  bias.dim() == 4, "rows_attention: q [B, H, G, D], kv [2, N, D], idx [B, H, T], bias [B, H, 1, T]");
  const at::Tensor q = q_in.contiguous(), idx = idx_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), T = idx.size(2), N = kv.size(1);
  TORCH_CHECK(kv.size(2) == D && idx.size(0) == B && idx.size(1) == H && bias.size(0) == B && bias.size(1) == H &&
                  bias.size(3) >= T && bias.stride(3) == 1, "rows_attention: shapes do not match");
  const int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t x = 0; x < B * H * T; ++x)
    TORCH_CHECK(I[x] >= 0 && I[x] < N, "rows_attention: a row out of the storage");
  const float* Bi = bias.data_ptr<float>();
  const int64_t b0 = bias.stride(0), b1 = bias.stride(1);
  return heads_attention(q, kv, T, scale, [&](int64_t bh) {
    const int64_t* ix = I + bh * T;
    return std::make_tuple([ix](int64_t x) { return ix[x]; }, Bi + (bh / H) * b0 + (bh % H) * b1, T);
  });
}

// A decode query's exact attention over per-head segments of packed storage (packed.py: a layer whose KV heads hold
// different numbers of tokens, each (batch row, KV head) a run of consecutive slots of its storage row). q [B, H, G,
// D] fp32 (the query heads of each KV head), kv [2, N, D] (the storage's rows flattened; unit stride over D), bias
// [M] fp32 (the packing's additive bias flattened: 0 held, -inf not read, or a carried bias), seg [3, B * H] int64:
// each segment's first row of kv, its first entry of bias, its length. Returns out [B, H, G, D] = softmax(q . k *
// scale + bias) @ v over each segment's slots only — where one SDPA over a packed row scores every segment of the row
// for every query head and masks the others' (3x the keys on a row of 3 heads), in one work item per row.
at::Tensor segments_attention(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& bias,
                              const at::Tensor& seg_in, double scale) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat && seg_in.scalar_type() == at::kLong,
              "segments_attention: fp32 query, storage and bias, int64 segments");
  TORCH_CHECK(q_in.dim() == 4 && kv.dim() == 3 && kv.size(0) == 2 && kv.stride(2) == 1 && bias.dim() == 1 &&
                  bias.stride(0) == 1 && seg_in.dim() == 2 && seg_in.size(0) == 3,
              "segments_attention: q [B, H, G, D], kv [2, N, D], bias [M], seg [3, B * H]");
  const at::Tensor q = q_in.contiguous(), seg = seg_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), N = kv.size(1), M = bias.size(0);
  TORCH_CHECK(kv.size(2) == D && seg.size(1) == B * H, "segments_attention: shapes do not match");
  const int64_t* S = seg.data_ptr<int64_t>();
  const int64_t BH = B * H;
  int64_t T = 0;
  for (int64_t x = 0; x < BH; ++x) {
    TORCH_CHECK(S[x] >= 0 && S[2 * BH + x] > 0 && S[x] + S[2 * BH + x] <= N && S[BH + x] >= 0 &&
                    S[BH + x] + S[2 * BH + x] <= M, "segments_attention: a segment out of the storage");
    T = std::max(T, S[2 * BH + x]);
  }
  const float* Bi = bias.data_ptr<float>();
  return heads_attention(q, kv, T, scale, [&](int64_t bh) {
    const int64_t first = S[bh];
    return std::make_tuple([first](int64_t x) { return first + x; }, Bi + S[BH + bh], S[2 * BH + bh]);
  });
}

// LycheeCluster's new chunk keys on the CPU (lychee.LycheePolicy.pool at a lazy update, as one call): keys
// [B, H, T, D] fp32 (rows of unit stride; a view of the storage) and the chunks' bounds (k + 1 ints, slots of
// keys: chunk j is bounds[j] .. bounds[j + 1] - 1); each chunk's mean (summed in slot order, then divided by its
// length) or per-channel maximum, then normalised (x / max(|x|, 1e-12)). [B, H, k, D].
at::Tensor lychee_pool(const at::Tensor& keys, at::IntArrayRef bounds, bool max) {
  TORCH_CHECK(keys.scalar_type() == at::kFloat && keys.dim() == 4 && keys.stride(3) == 1,
              "lychee_pool: fp32 keys [B, H, T, D] with rows of unit stride");
  const int64_t B = keys.size(0), H = keys.size(1), T = keys.size(2), D = keys.size(3);
  const int64_t k = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t* Bd = bounds.data();
  for (int64_t j = 0; j < k; ++j)
    TORCH_CHECK(0 <= Bd[j] && Bd[j] < Bd[j + 1] && Bd[j + 1] <= T, "lychee_pool: chunk bounds out of the keys");
  at::Tensor out = at::empty({B, H, k, D}, keys.options());
  const float* K = keys.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const float* kb = K + (bh / H) * s0 + (bh % H) * s1;
      for (int64_t j = 0; j < k; ++j) {
        float* o = O + (bh * k + j) * D;
        std::fill(o, o + D, max ? ninf : 0.f);
        for (int64_t t = Bd[j]; t < Bd[j + 1]; ++t) {
          const float* row = kb + t * s2;
          if (max)
            for (int64_t e = 0; e < D; ++e) o[e] = std::max(o[e], row[e]);
          else
            for (int64_t e = 0; e < D; ++e) o[e] += row[e];
        }
        if (!max) {
          const float n = static_cast<float>(Bd[j + 1] - Bd[j]);
          for (int64_t e = 0; e < D; ++e) o[e] /= n;
        }
        float nn = 0.f;
        for (int64_t e = 0; e < D; ++e) nn += o[e] * o[e];
        const float den = std::max(std::sqrt(nn), 1e-12f);
        for (int64_t e = 0; e < D; ++e) o[e] /= den;
      }
    }
  });
  return out;
}

// One lazy update's grow of one (row, KV head)'s nodes (fine clusters or units; lychee_index_add below): every node
// a new chunk joins (node[j] for chunk j of x [k, D]) updated once, at its first new member.
void grow_nodes(float* mu, float* r, float* cnt, float* tok, const float* x, const float* lens,
                const int64_t* node, int64_t k, int64_t D, std::vector<float>& mu2) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t a = node[j];
    bool first = true;
    for (int64_t i = 0; i < j; ++i) first = first && node[i] != a;
    if (!first) continue;
    float* m = mu + a * D;
    const float n0 = cnt[a];
    float n1 = n0, tk = 0.f;
    for (int64_t e = 0; e < D; ++e) mu2[e] = m[e] * n0;
    for (int64_t i = j; i < k; ++i) {
      if (node[i] != a) continue;
      n1 += 1.f;
      tk += lens[i];
      for (int64_t e = 0; e < D; ++e) mu2[e] += x[i * D + e];
    }
    float shift = 0.f;
    for (int64_t e = 0; e < D; ++e) {
      const float v = mu2[e] / n1;
      shift += (v - m[e]) * (v - m[e]);
      m[e] = v;
    }
    float rad = n0 > 0.f ? r[a] + std::sqrt(shift) : 0.f;
    for (int64_t i = j; i < k; ++i) {
      if (node[i] != a) continue;
      float d2 = 0.f;
      for (int64_t e = 0; e < D; ++e) d2 += (x[i * D + e] - m[e]) * (x[i * D + e] - m[e]);
      rad = std::max(rad, std::sqrt(d2));
    }
    r[a] = rad;
    cnt[a] = n1;
    tok[a] += tk;
  }
}

// LycheeCluster's lazy index update on the CPU (lychee.LycheePolicy.lazy_update; the same rule as torch ops, in
// LycheePolicy._grow, is the path CUDA runs and the tests' reference), where the torch ops cost ~40 small launches
// per chunk closing and layer. x [B, H, k, D] fp32: the k new chunks' normalised keys; each joins the live fine
// cluster (cnt_c > 0) of the largest x . mu / max(|mu|, 1e-12) (all k chosen before any centroid moves; ties: the
// lower index) and that cluster's unit (parent [B, H, L]). Every node a new chunk joins: count + its new members,
// centroid = the members' mean (moving average), radius = r + |centroid shift| (0 if it was empty), then at least
// each new member's distance to the new centroid; its token count + the members' lens [k]. Nodes no chunk joins are
// left as they are. In place (contiguous fp32): mu_c [B, H, L, D], r_c, cnt_c, tok_c [B, H, L]; mu_g [B, H, P, D],
// r_g, cnt_g, tok_g [B, H, P]; assign [B, H, >= M0 + k] (int64) gets the new chunks' clusters at M0 ...
void lychee_index_add(const at::Tensor& x_in, const at::Tensor& lens_in, const at::Tensor& mu_c,
                      const at::Tensor& r_c, const at::Tensor& cnt_c, const at::Tensor& tok_c,
                      const at::Tensor& parent_in, const at::Tensor& mu_g, const at::Tensor& r_g,
                      const at::Tensor& cnt_g, const at::Tensor& tok_g, const at::Tensor& assign, int64_t M0) {
  for (const at::Tensor* t : {&x_in, &lens_in, &mu_c, &r_c, &cnt_c, &tok_c, &mu_g, &r_g, &cnt_g, &tok_g})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "lychee_index_add: fp32 keys, lengths and index");
  for (const at::Tensor* t : {&mu_c, &r_c, &cnt_c, &tok_c, &mu_g, &r_g, &cnt_g, &tok_g, &assign})
    TORCH_CHECK(t->is_contiguous(), "lychee_index_add: the index tensors it updates must be contiguous");
  const at::Tensor x = x_in.contiguous(), lens = lens_in.contiguous(), parent = parent_in.contiguous();
  const int64_t B = x.size(0), H = x.size(1), k = x.size(2), D = x.size(3);
  const int64_t L = mu_c.size(2), P = mu_g.size(2), cap = assign.size(2);
  TORCH_CHECK(lens.numel() == k && mu_c.size(3) == D && mu_g.size(3) == D && parent.size(2) == L &&
                  assign.scalar_type() == at::kLong && parent.scalar_type() == at::kLong && M0 + k <= cap,
              "lychee_index_add: shapes do not match");
  const float *X = x.data_ptr<float>(), *Ln = lens.data_ptr<float>();
  float *Mc = mu_c.data_ptr<float>(), *Rc = r_c.data_ptr<float>(), *Cc = cnt_c.data_ptr<float>();
  float *Tc = tok_c.data_ptr<float>(), *Mg = mu_g.data_ptr<float>(), *Rg = r_g.data_ptr<float>();
  float *Cg = cnt_g.data_ptr<float>(), *Tg = tok_g.data_ptr<float>();
  const int64_t* Pa = parent.data_ptr<int64_t>();
  int64_t* As = assign.data_ptr<int64_t>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {
    std::vector<float> dir(L * D), tmp(D);
    std::vector<int64_t> c(k), g(k);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      float* mc = Mc + bh * L * D;
      const float* cc = Cc + bh * L;
      for (int64_t l = 0; l < L; ++l) {  // each cluster's direction (F.normalize's rule)
        float nn = 0.f;
        for (int64_t e = 0; e < D; ++e) nn += mc[l * D + e] * mc[l * D + e];
        const float den = std::max(std::sqrt(nn), 1e-12f);
        for (int64_t e = 0; e < D; ++e) dir[l * D + e] = mc[l * D + e] / den;
      }
      const float* xb = X + bh * k * D;
      for (int64_t j = 0; j < k; ++j) {  // the nearest live cluster
        float best = ninf;
        int64_t arg = 0;
        for (int64_t l = 0; l < L; ++l) {
          if (!(cc[l] > 0.f)) continue;
          float s = 0.f;
          for (int64_t e = 0; e < D; ++e) s += xb[j * D + e] * dir[l * D + e];
          if (s > best) { best = s; arg = l; }
        }
        c[j] = arg;
        g[j] = Pa[bh * L + arg];
        As[bh * cap + M0 + j] = arg;
      }
      grow_nodes(mc, Rc + bh * L, Cc + bh * L, Tc + bh * L, xb, Ln, c.data(), k, D, tmp);
      grow_nodes(Mg + bh * P * D, Rg + bh * P, Cg + bh * P, Tg + bh * P, xb, Ln, g.data(), k, D, tmp);
    }
  });
}

// LycheeCluster's decode table (lychee_decode.DecodePath.rebuild as one call on the CPU): tab [B, H, D + G + 1,
// P + L + M] fp32 — the units' and fine clusters' centroids and the M chunks' keys (ck [B, H, >= M, D], rows of unit
// stride) as columns, each node's radius in the G rows below (0 for chunks), 0 or -inf (an empty node) in the last
// — each chunk's unit parent[assign] and cluster column P + assign [B, H, M].
std::tuple<at::Tensor, at::Tensor, at::Tensor> lychee_table(
    const at::Tensor& mu_g_in, const at::Tensor& r_g_in, const at::Tensor& cnt_g_in, const at::Tensor& mu_c_in,
    const at::Tensor& r_c_in, const at::Tensor& cnt_c_in, const at::Tensor& ck, const at::Tensor& assign,
    const at::Tensor& parent_in, int64_t M, int64_t G) {
  const at::Tensor mu_g = mu_g_in.contiguous(), r_g = r_g_in.contiguous(), cnt_g = cnt_g_in.contiguous();
  const at::Tensor mu_c = mu_c_in.contiguous(), r_c = r_c_in.contiguous(), cnt_c = cnt_c_in.contiguous();
  const at::Tensor parent = parent_in.contiguous();
  for (const at::Tensor* t : {&mu_g, &r_g, &cnt_g, &mu_c, &r_c, &cnt_c, &ck})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "lychee_table: an fp32 index");
  const int64_t B = mu_g.size(0), H = mu_g.size(1), P = mu_g.size(2), D = mu_g.size(3), L = mu_c.size(2);
  TORCH_CHECK(ck.stride(3) == 1 && ck.size(2) >= M && assign.size(2) >= M && assign.scalar_type() == at::kLong &&
                  parent.size(2) == L, "lychee_table: shapes do not match");
  const int64_t E = D + G + 1, N = P + L + M;
  at::Tensor tab = at::empty({B, H, E, N}, mu_g.options());
  at::Tensor unit = at::empty({B, H, M}, assign.options()), cluster = at::empty({B, H, M}, assign.options());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* t = tab.data_ptr<float>() + bh * E * N;
      const float* mg = mu_g.data_ptr<float>() + bh * P * D;
      const float* mc = mu_c.data_ptr<float>() + bh * L * D;
      const float* kc = ck.data_ptr<float>() + b * ck.stride(0) + h * ck.stride(1);
      const int64_t ks = ck.stride(2);
      for (int64_t e = 0; e < D; ++e) {
        float* row = t + e * N;
        for (int64_t p = 0; p < P; ++p) row[p] = mg[p * D + e];
        for (int64_t l = 0; l < L; ++l) row[P + l] = mc[l * D + e];
        for (int64_t m = 0; m < M; ++m) row[P + L + m] = kc[m * ks + e];
      }
      const float *rg = r_g.data_ptr<float>() + bh * P, *rc = r_c.data_ptr<float>() + bh * L;
      for (int64_t i = 0; i < G; ++i) {
        float* row = t + (D + i) * N;
        std::memcpy(row, rg, P * sizeof(float));
        std::memcpy(row + P, rc, L * sizeof(float));
        std::fill(row + P + L, row + N, 0.f);
      }
      float* last = t + (E - 1) * N;
      const float *cg = cnt_g.data_ptr<float>() + bh * P, *cc = cnt_c.data_ptr<float>() + bh * L;
      for (int64_t p = 0; p < P; ++p) last[p] = cg[p] <= 0.f ? ninf : 0.f;
      for (int64_t l = 0; l < L; ++l) last[P + l] = cc[l] <= 0.f ? ninf : 0.f;
      std::fill(last + P + L, last + N, 0.f);
      const int64_t* as = assign.data_ptr<int64_t>() + b * assign.stride(0) + h * assign.stride(1);
      const int64_t* pa = parent.data_ptr<int64_t>() + bh * L;
      int64_t *u = unit.data_ptr<int64_t>() + bh * M, *cl = cluster.data_ptr<int64_t>() + bh * M;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t a = as[m * assign.stride(2)];
        u[m] = pa[a];
        cl[m] = P + a;
      }
    }
  });
  return {tab, unit, cluster};
}

}  // namespace

TORCH_LIBRARY(luka_bench, lib) {
  lib.def("attention_mass(Tensor qs, Tensor k, Tensor v, int past, int block, bool entropy)"
          " -> (Tensor, Tensor, Tensor)");
  lib.def("lychee_decode(Tensor q, Tensor tab, Tensor chunk_unit, Tensor chunk_cluster, Tensor tok_g,"
          " Tensor slen, Tensor start_rows, Tensor rows, Tensor(a!) bias, int P, int L, bool ub, float[] unit_limit,"
          " int k_g, int[] R, int cmax, int C, int S, int[] fr, int[] n) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  lib.def("rows_attention(Tensor q, Tensor kv, Tensor idx, Tensor bias, float scale) -> Tensor");
  lib.def("segments_attention(Tensor q, Tensor kv, Tensor bias, Tensor seg, float scale) -> Tensor");
  lib.def("lychee_index_add(Tensor x, Tensor lens, Tensor(a!) mu_c, Tensor(b!) r_c, Tensor(c!) cnt_c,"
          " Tensor(d!) tok_c, Tensor parent, Tensor(e!) mu_g, Tensor(f!) r_g, Tensor(g!) cnt_g, Tensor(h!) tok_g,"
          " Tensor(i!) assign, int M0) -> ()");
  lib.def("lychee_table(Tensor mu_g, Tensor r_g, Tensor cnt_g, Tensor mu_c, Tensor r_c, Tensor cnt_c, Tensor ck,"
          " Tensor assign, Tensor parent, int M, int G) -> (Tensor, Tensor, Tensor)");
  lib.def("lychee_pool(Tensor keys, int[] bounds, bool max) -> Tensor");
}

TORCH_LIBRARY_IMPL(luka_bench, CPU, lib) {
  lib.impl("attention_mass", &attention_mass);
  lib.impl("lychee_decode", &lychee_decode);
  lib.impl("rows_attention", &rows_attention);
  lib.impl("segments_attention", &segments_attention);
  lib.impl("lychee_index_add", &lychee_index_add);
  lib.impl("lychee_table", &lychee_table);
  lib.impl("lychee_pool", &lychee_pool);
}
