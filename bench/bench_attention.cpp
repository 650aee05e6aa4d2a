// Google Benchmark for exact attention (built when libbenchmark-dev is installed): build/sattn_bench.
// Arguments: L, D, causal (0/1), threads. Counters: GFLOP/s (forward 4·B·H·L²·D, half for causal; backward
// 2.5x). For SGEMM ratios and JSON use `build/sattn bench`, which measures OpenBLAS in the same run.
#include <benchmark/benchmark.h>

#include <random>

#include "sattn/attention.hpp"

namespace {

struct Inputs {
  sattn::Tensor q, k, v, dout, out, lse, dq, dk, dv;
  Inputs(int64_t L, int64_t D) {
    const sattn::Shape s = {1, 8, L, D};
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (sattn::Tensor* t : {&q, &k, &v, &dout, &out, &dq, &dk, &dv}) {
      *t = sattn::Tensor(sattn::DType::kF32, s);
      for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = nd(rng);
    }
    lse = sattn::Tensor(sattn::DType::kF32, {1, 8, L});
  }
};

sattn::AttentionOptions options(const benchmark::State& st) {
  sattn::AttentionOptions o;
  o.causal = st.range(2) ? sattn::Causal::kTopLeft : sattn::Causal::kNone;
  o.num_threads = int(st.range(3));
  o.kernel = "fused";
  return o;
}

double flops(const benchmark::State& st) {
  const double L = double(st.range(0)), D = double(st.range(1));
  return 4.0 * 8 * L * L * D * (st.range(2) ? 0.5 : 1.0);
}

void BM_Forward(benchmark::State& st) {
  Inputs in(st.range(0), st.range(1));
  const auto o = options(st);
  for (auto _ : st) sattn::scaled_dot_product_attention(in.q, in.k, in.v, o, {in.out.view(), in.lse.view(), {}});
  st.counters["GFLOP/s"] = benchmark::Counter(flops(st) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Backward(benchmark::State& st) {
  Inputs in(st.range(0), st.range(1));
  const auto o = options(st);
  sattn::scaled_dot_product_attention(in.q, in.k, in.v, o, {in.out.view(), in.lse.view(), {}});
  for (auto _ : st)
    sattn::scaled_dot_product_attention_backward(in.dout, in.q, in.k, in.v, in.out, in.lse, o,
                                                 {in.dq.view(), in.dk.view(), in.dv.view(), {}});
  st.counters["GFLOP/s"] = benchmark::Counter(2.5 * flops(st) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t threads : {1, 2})
    for (int64_t D : {64, 128})
      for (int64_t L : {512, 1024, 4096})
        for (int64_t causal : {0, 1}) b->Args({L, D, causal, threads});
  b->ArgNames({"L", "D", "causal", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_Forward)->Apply(Args);
BENCHMARK(BM_Backward)->Apply(Args);

}  // namespace

BENCHMARK_MAIN();
