// Shared by the tool subcommands (viz, doctor, report): the q/k/v and mask options of `sattn attn`, with the
// same polarity — --mask bool True = may attend or float additive; --key-padding bool [B, Lk] True = padding;
// --lengths int [B]; --causal top-left|bottom-right.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "sattn/attention.hpp"
#include "sattn/io.hpp"

namespace sattn::cli {

struct MaskArgs {
  std::string mask, key_padding, lengths, causal;
  double scale = 0;
  bool has_scale = false;
};

inline void add_mask_options(CLI::App* cmd, MaskArgs& a, bool with_scale) {
  cmd->add_option("--mask", a.mask,
                  "attn_mask .npy: bool (True = may attend) or float (additive), broadcastable to "
                  "[B, Hq, Lq, Lk]")
      ->check(CLI::ExistingFile);
  auto* kp = cmd->add_option("--key-padding", a.key_padding, "key padding .npy: bool [B, Lk], True = padding")
                 ->check(CLI::ExistingFile);
  auto* ln = cmd->add_option("--lengths", a.lengths, "key lengths .npy: int32/int64 [B]; keys j >= n[b] are padding")
                 ->check(CLI::ExistingFile);
  kp->excludes(ln);
  ln->excludes(kp);
  cmd->add_option("--causal", a.causal,
                  "causal mask alignment: top-left (PyTorch is_causal) or bottom-right "
                  "(FlashAttention)")
      ->check(CLI::IsMember({"top-left", "bottom-right", "top_left", "bottom_right", "none"}));
  if (with_scale)
    cmd->add_option("--scale", a.scale, "softmax scale (default 1/sqrt(D))")->each([&a](const std::string&) {
      a.has_scale = true;
    });
}

// Owns the loaded tensors; `options` holds views into them.
struct LoadedMasks {
  Tensor mask, key_padding, lengths;
  AttentionOptions options;
};

inline LoadedMasks load_masks(const MaskArgs& a) {
  LoadedMasks m;
  if (!a.mask.empty()) {
    m.mask = read_npy(a.mask);
    m.options.attn_mask = m.mask.view();
  }
  if (!a.key_padding.empty()) {
    m.key_padding = read_npy(a.key_padding);
    m.options.key_padding_mask = m.key_padding.view();
  }
  if (!a.lengths.empty()) {
    m.lengths = read_npy(a.lengths);
    m.options.key_lengths = m.lengths.view();
  }
  if (!a.causal.empty()) m.options.causal = parse_causal(a.causal, "--causal");
  if (a.has_scale) m.options.scale = a.scale;
  return m;
}

// --out DIR of the commands that write a folder of files: created with its parents.
inline void create_output_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  check(!ec, ErrorKind::kIO, "--out: cannot create the directory '", dir, "': ", ec.message());
}

// Progress on stderr only when it is a terminal; quiet when piped or redirected.
inline bool stderr_is_tty() { return isatty(fileno(stderr)) != 0; }

}  // namespace sattn::cli
