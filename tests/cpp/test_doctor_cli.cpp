// `sattn doctor` from the shell: exit 0 healthy, 1 findings, 2 bad usage; --json output.
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

#include "sattn/io.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::testing_tools;

namespace {
std::string setup(const std::string& name) {
  const std::string dir = temp_dir(name);
  write_npy(dir + "/q.npy", randn({1, 2, 24, 32}, 1));
  write_npy(dir + "/k.npy", randn({1, 2, 24, 32}, 2));
  write_npy(dir + "/v.npy", randn({1, 2, 24, 32}, 3));
  return dir;
}
std::vector<std::string> json_codes(const std::string& out) {
  std::vector<std::string> c;
  const nlohmann::json j = nlohmann::json::parse(out);
  for (const auto& f : j["findings"]) c.push_back(f["code"].get<std::string>());
  return c;
}
bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}
}  // namespace

TEST(DoctorCli, HealthyExitsZero) {
  ASSERT_TRUE(have_binary());
  const std::string dir = setup("doc_ok");
  RunResult r = run_sattn("doctor --q q.npy --k k.npy --v v.npy", dir);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("healthy"), std::string::npos);
  r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --causal top-left --expect causal --json", dir);
  EXPECT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["findings"].empty());
  EXPECT_EQ(j["stats"]["heads"].size(), 2u);
}

TEST(DoctorCli, SeededSymptomsExitOne) {
  ASSERT_TRUE(have_binary());
  const std::string dir = setup("doc_bad");
  RunResult r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --scale 1 --json", dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(json_codes(r.out), "unscaled_scores")) << r.out;
  // Reversed causal mask (True above the diagonal) with --expect causal.
  Tensor rev(DType::kBool, {24, 24});
  for (int64_t i = 0; i < 24; ++i)
    for (int64_t j = 0; j < 24; ++j) rev.data<uint8_t>()[i * 24 + j] = j > i;
  write_npy(dir + "/rev.npy", rev);
  r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --mask rev.npy --expect causal --json", dir);
  EXPECT_EQ(r.code, 1);
  auto c = json_codes(r.out);
  EXPECT_TRUE(contains(c, "causal_leak")) << r.out;
  EXPECT_TRUE(contains(c, "mask_polarity_suspect")) << r.out;
  // Padding given as lengths but not applied by the mask.
  Tensor n(DType::kI64, {1});
  n.data<int64_t>()[0] = 15;
  write_npy(dir + "/n.npy", n);
  r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --lengths n.npy --expect padding --json", dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(json_codes(r.out), "padding_leak")) << r.out;
  // Fully masked row.
  Tensor row(DType::kBool, {24, 24});
  for (int64_t i = 0; i < 24; ++i)
    for (int64_t j = 0; j < 24; ++j) row.data<uint8_t>()[i * 24 + j] = i != 7;
  write_npy(dir + "/row.npy", row);
  r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --mask row.npy", dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("[fully_masked_rows]"), std::string::npos) << r.out;
  // NaN input.
  Tensor qn = randn({1, 2, 24, 32}, 1);
  qn.data<float>()[100] = std::numeric_limits<float>::quiet_NaN();
  write_npy(dir + "/qn.npy", qn);
  r = run_sattn("doctor --q qn.npy --k k.npy --v v.npy --json", dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(json_codes(r.out), "nan_or_inf")) << r.out;
}

TEST(DoctorCli, BadUsageExitsTwo) {
  ASSERT_TRUE(have_binary());
  const std::string dir = setup("doc_usage");
  EXPECT_EQ(run_sattn("doctor --q q.npy --k k.npy", dir).code, 2);                            // no --v
  EXPECT_EQ(run_sattn("doctor --q q.npy --k k.npy --v v.npy --expect future", dir).code, 2);  // bad --expect
  EXPECT_EQ(run_sattn("doctor --q q.npy --k k.npy --v v.npy --causal diagonal", dir).code, 2);
  Tensor n(DType::kI64, {1});
  write_npy(dir + "/n.npy", n);
  Tensor kp(DType::kBool, {1, 24});
  write_npy(dir + "/kp.npy", kp);
  EXPECT_EQ(run_sattn("doctor --q q.npy --k k.npy --v v.npy --lengths n.npy --key-padding kp.npy", dir).code, 2);
  write_npy(dir + "/m.npy", randn({5, 5}, 4));
  const RunResult r = run_sattn("doctor --q q.npy --k k.npy --v v.npy --mask m.npy", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("attn_mask"), std::string::npos) << r.err;
}

TEST(DoctorCli, PlotDrawsFindingsInTheFlagColourOnlyWhenThereAreFindings) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("doctor_plot");
  auto count_flag = [](const Decoded& d) {  // the vermillion of flagged bars and finding lines
    int64_t n = 0;
    for (size_t p = 0; p + 2 < d.rgb.size(); p += 3) n += d.rgb[p] == 213 && d.rgb[p + 1] == 94 && d.rgb[p + 2] == 0;
    return n;
  };
  RunResult r = run_sattn("doctor --example --scale 1 --plot sick.png", dir);
  ASSERT_EQ(r.code, 1) << r.err;
  const Decoded sick = decode_png_file(dir + "/sick.png");
  ASSERT_TRUE(sick.ok);
  EXPECT_GT(sick.width, 900);
  EXPECT_GT(sick.height, 250);
  EXPECT_GT(count_flag(sick), 3 * 40 * 100);  // at least three tall flagged bars
  r = run_sattn("doctor --example --plot healthy.png", dir);
  ASSERT_EQ(r.code, 0) << r.out;
  const Decoded healthy = decode_png_file(dir + "/healthy.png");
  ASSERT_TRUE(healthy.ok);
  EXPECT_TRUE(healthy.non_constant());
  EXPECT_EQ(count_flag(healthy), 0);
  r = run_sattn("doctor --example --plot d.gif", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--plot"), std::string::npos) << r.err;
}
