// The tool subcommands as a user runs them: `sattn viz`, `sattn profile`, `sattn report` (exit codes, files).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>

#include "sattn/io.hpp"
#include "sattn/mha.hpp"
#include "sattn/safetensors.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::testing_tools;
namespace fs = std::filesystem;

namespace {
void write_qkv(const std::string& dir, int64_t B, int64_t H, int64_t L, int64_t D) {
  write_npy(dir + "/q.npy", randn({B, H, L, D}, 1));
  write_npy(dir + "/k.npy", randn({B, H, L, D}, 2));
  write_npy(dir + "/v.npy", randn({B, H, L, D}, 3));
}
}  // namespace

TEST(VizCli, WritesHeadMapsGridAndQueryFocus) {
  ASSERT_TRUE(have_binary()) << "SATTN_BINARY_DIR/sattn not found";
  const std::string dir = temp_dir("viz");
  write_qkv(dir, 2, 3, 20, 8);
  Tensor lengths(DType::kI64, {2});
  lengths.data<int64_t>()[0] = 20;
  lengths.data<int64_t>()[1] = 13;
  write_npy(dir + "/n.npy", lengths);
  const RunResult r = run_sattn(
      "viz --q q.npy --k k.npy --lengths n.npy --causal bottom-right --query 4 --query 19 "
      "--out maps",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 3; ++h) {
      const std::string p = dir + "/maps/head_" + std::to_string(b) + "_" + std::to_string(h) + ".png";
      const Decoded d = decode_png_file(p);
      ASSERT_TRUE(d.ok) << p;
      EXPECT_GT(d.width, 300);
      EXPECT_GT(d.height, 300);
      EXPECT_TRUE(d.non_constant());
      EXPECT_GT(d.distinct_colours(), 10);
    }
  const Decoded grid = decode_png_file(dir + "/maps/heads.png");
  ASSERT_TRUE(grid.ok);
  EXPECT_GT(grid.width, 3 * 160);   // three panels per row
  EXPECT_GT(grid.height, 2 * 160);  // two batch entries
  for (const char* q : {"query_4.png", "query_19.png"}) {
    const Decoded d = decode_png_file(dir + "/maps/" + q);
    ASSERT_TRUE(d.ok) << q;
    EXPECT_TRUE(d.non_constant());
  }
  EXPECT_NE(r.out.find("heads.png"), std::string::npos);
  EXPECT_EQ(r.err, "");  // stderr is not a terminal: no progress output
}

TEST(VizCli, BadUsageExitsTwo) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_bad");
  write_qkv(dir, 1, 1, 6, 4);
  RunResult r = run_sattn("viz --q q.npy --k k.npy", dir);  // no --out
  EXPECT_EQ(r.code, 2);
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'SlidingWindow(2,, 0)' --out o", dir);  // bad spec
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("pattern spec"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("at position 16"), std::string::npos) << r.err;
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'Spiral(3)' --out o", dir);  // unknown pattern
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("position"), std::string::npos) << r.err;
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'Neighborhood2D(3, 3, 3)' --out o", dir);  // 9 != L = 6
  EXPECT_EQ(r.code, 2);
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'ReLUAttention()' --out o", dir);  // weights are no softmax
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("TopK"), std::string::npos) << r.err;
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'TopK(2)' --causal top-left --out o", dir);
  EXPECT_EQ(r.code, 2);  // the selection would not see the causal mask
  EXPECT_NE(r.err.find("--causal"), std::string::npos) << r.err;
  r = run_sattn("viz --q q.npy --k k.npy --query 6 --out o", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--query"), std::string::npos) << r.err;
  r = run_sattn("viz --q q.npy --k missing.npy --out o", dir);
  EXPECT_EQ(r.code, 2);
  write_npy(dir + "/k3.npy", randn({1, 1, 6, 3}, 9));
  r = run_sattn("viz --q q.npy --k k3.npy --out o", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("key"), std::string::npos) << r.err;
}

namespace {
int64_t grey_pixels(const Decoded& d) {
  int64_t n = 0;
  for (size_t p = 0; p + 2 < d.rgb.size(); p += 3) n += d.rgb[p] == 200 && d.rgb[p + 1] == 200 && d.rgb[p + 2] == 200;
  return n;
}
void expect_picture(const std::string& path, int min_side) {
  const Decoded d = decode_png_file(path);
  ASSERT_TRUE(d.ok) << path;
  EXPECT_GT(d.width, min_side) << path;
  EXPECT_GT(d.height, min_side) << path;
  EXPECT_TRUE(d.non_constant()) << path;
}
}  // namespace

TEST(VizCli, FixedPatternDrawsThePatternAndMapsUnderIt) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_pattern");
  write_qkv(dir, 1, 2, 24, 8);
  RunResult r = run_sattn("viz --q q.npy --k k.npy --out dense", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'SlidingWindow(3, 0)' --out sw", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_picture(dir + "/sw/pattern.png", 300);
  EXPECT_FALSE(fs::exists(dir + "/sw/pattern_h0.png"));  // the pattern does not depend on the head
  EXPECT_NE(r.out.find("pattern.png"), std::string::npos);
  // Outside the window the keys are masked (grey); the dense run of the same inputs has no grey cell.
  const Decoded pat = decode_png_file(dir + "/sw/pattern.png");
  const Decoded dense = decode_png_file(dir + "/dense/head_0_1.png");
  const Decoded sw = decode_png_file(dir + "/sw/head_0_1.png");
  ASSERT_TRUE(pat.ok && dense.ok && sw.ok);
  EXPECT_GT(grey_pixels(pat), 300 * 300 / 2);  // 24*24 cells, 90 of them allowed
  EXPECT_GT(grey_pixels(sw), 300 * 300 / 2);
  EXPECT_LT(grey_pixels(dense), 300 * 300 / 20);
  EXPECT_GT(sw.distinct_colours(), 10);
  expect_picture(dir + "/sw/heads.png", 160);
  // A head-dependent pattern (BigBird's random blocks) is drawn per head, intersected with the CLI's masks.
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'BigBird(4, 1, 1, 1, seed=3)' --causal bottom-right --out bb", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_picture(dir + "/bb/pattern_h0.png", 300);
  expect_picture(dir + "/bb/pattern_h1.png", 300);
  EXPECT_FALSE(fs::exists(dir + "/bb/pattern.png"));
  expect_picture(dir + "/bb/head_0_0.png", 300);
  // Different random blocks per head: the two pattern pictures differ.
  EXPECT_NE(decode_png_file(dir + "/bb/pattern_h0.png").rgb, decode_png_file(dir + "/bb/pattern_h1.png").rgb);
}

TEST(VizCli, AdaptivePatternDrawsTheSelectedKeys) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_topk");
  write_qkv(dir, 2, 2, 16, 8);
  RunResult r = run_sattn("viz --q q.npy --k k.npy --pattern 'TopK(3)' --out tk", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h) {
      const std::string sel = dir + "/tk/selected_" + std::to_string(b) + "_" + std::to_string(h) + ".png";
      expect_picture(sel, 300);
      EXPECT_GT(grey_pixels(decode_png_file(sel)), 300 * 300 / 2);  // 3 of 16 keys per query
      expect_picture(dir + "/tk/head_" + std::to_string(b) + "_" + std::to_string(h) + ".png", 300);
    }
  expect_picture(dir + "/tk/selected.png", 2 * 160);
  // Selections differ between heads (different q, k).
  EXPECT_NE(decode_png_file(dir + "/tk/selected_0_0.png").rgb, decode_png_file(dir + "/tk/selected_0_1.png").rgb);
  r = run_sattn("viz --q q.npy --k k.npy --pattern 'BlockTopK(4, 2, causal=True)' --out btk", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_picture(dir + "/btk/selected_1_1.png", 300);
  expect_picture(dir + "/btk/head_1_1.png", 300);
}

TEST(VizCli, MultiheadAttentionPerHeadWeights) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_mha");
  const nn::MultiheadAttention mha(8, 2, 0.0, true, false, false, std::nullopt, 6, false, DType::kF32, 5);
  std::map<std::string, TensorView> tensors;
  const auto sd = mha.state_dict();
  for (const auto& [name, t] : sd) tensors[name] = t.view();
  write_safetensors(dir + "/mha.safetensors", tensors);
  write_npy(dir + "/x.npy", randn({10, 2, 8}, 11));  // [L, N, E]
  write_npy(dir + "/kv.npy", randn({7, 2, 8}, 12));  // [S, N, E]
  write_npy(dir + "/v.npy", randn({7, 2, 6}, 13));   // [S, N, vdim]
  RunResult r = run_sattn(
      "viz --mha mha.safetensors --embed-dim 8 --num-heads 2 --x x.npy --key kv.npy "
      "--value v.npy --out m",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h) {
      const std::string p = dir + "/m/head_" + std::to_string(b) + "_" + std::to_string(h) + ".png";
      expect_picture(p, 300);
      EXPECT_GT(decode_png_file(p).distinct_colours(), 10) << p;
    }
  EXPECT_NE(decode_png_file(dir + "/m/head_0_0.png").rgb, decode_png_file(dir + "/m/head_0_1.png").rgb);
  expect_picture(dir + "/m/heads.png", 2 * 160);
  expect_picture(dir + "/m/query_5.png", 100);
  // Self-attention on unbatched input [L, E].
  write_npy(dir + "/x2.npy", randn({9, 8}, 14));
  const nn::MultiheadAttention self(8, 2, 0.0, true, false, false, std::nullopt, std::nullopt, false, DType::kF32, 6);
  std::map<std::string, TensorView> t2;
  const auto sd2 = self.state_dict();
  for (const auto& [name, t] : sd2) t2[name] = t.view();
  write_safetensors(dir + "/self.safetensors", t2);
  r = run_sattn("viz --mha self.safetensors --embed-dim 8 --num-heads 2 --x x2.npy --out s", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_picture(dir + "/s/head_0_1.png", 300);
  // Bad usage: missing sizes, a wrong embed_dim (shape mismatch named), masks with --mha.
  r = run_sattn("viz --mha self.safetensors --x x2.npy --out s", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--embed-dim"), std::string::npos) << r.err;
  r = run_sattn("viz --mha self.safetensors --embed-dim 4 --num-heads 2 --x x2.npy --out s", dir);
  EXPECT_EQ(r.code, 2);
  r = run_sattn("viz --mha self.safetensors --embed-dim 8 --num-heads 2 --x x2.npy --causal top-left --out s", dir);
  EXPECT_EQ(r.code, 2);
}

TEST(ProfileCli, CsvTableAndPlots) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("profile");
  RunResult r = run_sattn("profile --L 16,32 --heads 1,2 --D 8 --repeats 1 --csv p.csv --plot p.svg", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string csv = read_text(dir + "/p.csv");
  EXPECT_EQ(csv.rfind("kernel,L,heads,ms,peak_mib,analytic_mib\n", 0), 0u) << csv;
  EXPECT_EQ(count_of(csv, "\nreference,"), 4u) << csv;
  EXPECT_NE(csv.find("reference,32,2,"), std::string::npos);
  const std::string svg = read_text(dir + "/p.svg");
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("peak memory"), std::string::npos);
  EXPECT_NE(r.out.find("analytic MiB"), std::string::npos);  // the terminal table
  EXPECT_EQ(r.err, "");                                      // piped: no progress
  r = run_sattn("profile --L 16 --heads 1 --D 8 --repeats 1 --plot p.png", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const Decoded d = decode_png_file(dir + "/p.png");
  ASSERT_TRUE(d.ok);
  EXPECT_TRUE(d.non_constant());
  r = run_sattn("profile --L 16 --heads 1 --kernels reference,warp9", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("warp9"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("available: "), std::string::npos) << r.err;
  r = run_sattn("profile --L 16 --heads 1 --plot p.gif", dir);
  EXPECT_EQ(r.code, 2);
}

TEST(ProfileCli, SparsePatternsAndLinearStayFarBelowTheScoreMatrix) {
  ASSERT_TRUE(have_binary());
  // L = 2048: a 64 MiB score matrix, far above the sparse kernels' peak RSS (1-2.5 MiB; up to 3 MiB in the sanitizer
  // build, whose shadow memory and quarantine add to every point: at L = 1024 BlockTopK's came within 2 % of a
  // quarter of its 16 MiB matrix there)
  const std::string dir = temp_dir("profile_sparse");
  const RunResult r = run_sattn(
      "profile --L 256,2048 --heads 4 --D 8 --repeats 1 --threads 1 --kernels reference "
      "--pattern 'SlidingWindow(32,32)' --pattern 'BlockTopK(64, 2)' --pattern linear:elu "
      "--csv p.csv --plot p.svg",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string csv = read_text(dir + "/p.csv");
  // kernel names with commas are quoted (RFC 4180); the pattern's repr() names it
  std::map<std::string, std::vector<double>> at2048;  // kernel -> peak_mib, analytic_mib
  std::istringstream lines(csv);
  std::string line;
  std::getline(lines, line);
  while (std::getline(lines, line)) {
    std::string kernel;
    size_t pos = 0;
    if (line[0] == '"') {
      pos = line.find('"', 1);
      kernel = line.substr(1, pos - 1);
      pos += 2;
    } else {
      pos = line.find(',');
      kernel = line.substr(0, pos);
      pos += 1;
    }
    std::vector<std::string> f;
    std::istringstream rest(line.substr(pos));
    for (std::string x; std::getline(rest, x, ',');) f.push_back(x);
    ASSERT_EQ(f.size(), 5u) << line;  // L, heads, ms, peak, analytic
    ASSERT_FALSE(f[2].empty()) << "point failed: " << line << "\n" << r.out;
    if (f[0] == "2048") at2048[kernel] = {std::stod(f[3]), std::stod(f[4])};
  }
  ASSERT_EQ(at2048.size(), 4u) << csv;
  for (const char* k : {"SlidingWindow(32, 32)", "BlockTopK(64, 2)", "linear:elu"}) {
    ASSERT_TRUE(at2048.count(k)) << k << "\n" << csv;
    EXPECT_DOUBLE_EQ(at2048[k][1], 64.0);              // B*h*L^2*4 bytes = 4 * 2048^2 * 4
    EXPECT_LT(at2048[k][0], 0.1 * at2048[k][1]) << k;  // sparse memory stays far below the dense score matrix
  }
  EXPECT_GE(at2048["reference"][0], 0.9 * 64.0);  // while the reference materialises it
  EXPECT_NE(read_text(dir + "/p.svg").find("SlidingWindow(32, 32) h=4"), std::string::npos);
  RunResult bad = run_sattn("profile --L 16 --heads 1 --pattern 'SlidingWindow(2,,3)'", dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("position 16"), std::string::npos) << bad.err;
  bad = run_sattn("profile --L 16 --heads 1 --causal --pattern 'SlidingWindow(2, 3)'", dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("causality into the pattern"), std::string::npos) << bad.err;
  bad = run_sattn("profile --L 16 --heads 1 --pattern linear:relu", dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("linear:elu"), std::string::npos) << bad.err;
}

TEST(ReportCli, ExampleAndGivenInputsMakeOneSelfContainedFile) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("report");
  RunResult r = run_sattn("report out.html --L 16,32 --heads 1 --repeats 1", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::string html = read_text(dir + "/out.html");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  EXPECT_GE(count_of(html, "src=\"data:image/png;base64,"), 2u);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("Doctor"), std::string::npos);
  EXPECT_EQ(html.find("src=\"http"), std::string::npos);  // nothing fetched from a network
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  // The embedded PNGs decode.
  const size_t p = html.find("base64,") + 7;
  const std::string b64 = html.substr(p, html.find('"', p) - p);
  EXPECT_GT(b64.size(), 1000u);
  write_qkv(dir, 1, 2, 12, 32);
  r = run_sattn("report given.html --q q.npy --k k.npy --v v.npy --scale 1 --no-profile", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  html = read_text(dir + "/given.html");
  EXPECT_NE(html.find("unscaled_scores"), std::string::npos);
  EXPECT_NE(html.find("q.npy"), std::string::npos);
  r = run_sattn("report bad.html --q q.npy", dir);
  EXPECT_EQ(r.code, 2);
}
