// The tool subcommands as a user runs them: `sattn viz`, `sattn profile`, `sattn report` (exit codes, files).
#include <gtest/gtest.h>

#include <filesystem>

#include "sattn/io.hpp"
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
  const RunResult r = run_sattn("viz --q q.npy --k k.npy --lengths n.npy --causal bottom-right --query 4 --query 19 "
                                "--out maps", dir);
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
  EXPECT_GT(grid.width, 3 * 160);  // three panels per row
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
  r = run_sattn("viz --q q.npy --k k.npy --pattern local:4 --out o", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("not yet available"), std::string::npos) << r.err;
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
  EXPECT_EQ(r.err, "");                                       // piped: no progress
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
