// Python: sattn.diagnose(q, k, v, ...) -> dict {"findings": [...], "stats": {...}} (see include/sattn/diagnose.hpp).
//
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "sattn/diagnose.hpp"

namespace sattn::py {
namespace {

namespace pyb = pybind11;

pyb::object diagnose_py(const pyb::object& q, const pyb::object& k, const pyb::object& v, const pyb::object& attn_mask,
                        const pyb::object& key_padding_mask, bool is_causal, const std::string& causal_alignment,
                        std::optional<double> scale, const std::optional<std::string>& expect) {
  ArrayKeeper keeper;  // the arrays behind the views (bind_common.hpp: viewed in place when the layout allows)
  const TensorView tq = view_of(q, "query", keeper), tk = view_of(k, "key", keeper), tv = view_of(v, "value", keeper);
  AttentionOptions o;
  DiagnoseOptions d;
  std::string json;
  {
    o.attn_mask = view_of(attn_mask, "attn_mask", keeper);
    const TensorView padding = view_of(key_padding_mask, "key_padding_mask", keeper);
    // bool [B, Lk] (True = padding) or integer lengths [B].
    if (padding.dtype == DType::kI32 || padding.dtype == DType::kI64) o.key_lengths = padding;
    else o.key_padding_mask = padding;
    const Causal align = parse_causal(causal_alignment, "causal_alignment");
    if (is_causal) o.causal = align == Causal::kNone ? Causal::kTopLeft : align;
    d.causal_alignment = align;
    o.scale = scale;
    d.expect = parse_expectation(expect.value_or("none"));
    pyb::gil_scoped_release release;  // the checks run the kernels: let other Python threads go on
    json = diagnosis_to_json(diagnose(tq, tk, tv, o, d), -1);
  }  // sattn::Error propagates to bind_core's translator (ValueError/TypeError/... subclasses of sattn.Error)
  return pyb::module_::import("json").attr("loads")(json);
}

}  // namespace

void bind_tools(pybind11::module_& m) {
  namespace pyb = pybind11;
  using namespace pyb::literals;
  m.def("diagnose", &diagnose_py, "query"_a, "key"_a, "value"_a, "attn_mask"_a = pyb::none(),
        "key_padding_mask"_a = pyb::none(), "is_causal"_a = false, "causal_alignment"_a = "top_left",
        "scale"_a = pyb::none(), "expect"_a = pyb::none(),
        "Health diagnostics of one attention call, as a dict {'findings': [{'code', 'heads', 'message'}], 'stats'}.\n"
        "Masks keep sattn/SDPA polarity: bool attn_mask True = may attend (float: additive); key_padding_mask bool\n"
        "[B, Lk] True = padding, or int [B] lengths. expect='causal' flags weight above the diagonal (alignment:\n"
        "causal_alignment); expect='padding' flags weight on padded keys -- the key_padding_mask/lengths then say\n"
        "where the padding is and are not applied. Codes: saturated_softmax, unscaled_scores, fully_masked_rows,\n"
        "nan_or_inf, causal_leak, padding_leak, mask_polarity_suspect, nondeterministic.");
}

}  // namespace sattn::py
